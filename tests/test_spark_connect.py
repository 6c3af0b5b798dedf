"""cdc_apply on a Spark Connect session, against Spark's own Connect server with Delta, started here
(``cdc_apply/spark/connect_server.py``). The client processes have no JVM: every commit goes through
Spark SQL, the DataFrame writer and the Delta log's files (docs/spark.md, "Spark Connect").

- `run --once` (the copy, then the stream with updates, deletes, ADD COLUMN ... DEFAULT, a truncate,
  a keyless table, soft deletes and SCD2 history): every target equals PostgreSQL, read by Spark and
  by delta-rs, and a second run applies nothing twice.
- a streaming query of ``format("pgoutput")`` with ``foreach_batch`` run by the server's Python worker,
  and `cdc-apply stream` with its checkpoint.
- kill -9 of a Connect client (`run --follow`) under load: 0 lost, 0 applied twice.
- `follow-changelog --once` and `trim-changelog` (`changelog.targets: separate`).
- `capture`, `replay` (of a capture, and of the change log into another warehouse), a batch
  ``format("pgoutput")`` read, `status` and `resync`, each a Connect client.
- a client killed -9 mid-write, whose commit the server finishes: the restarted client's fence
  (``apply/fence.py``) leaves nothing to land after it.
- the classic session's public path (``target.delta_internals: false``) on the same workload.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from cdc_apply.apply.targets import Target
from cdc_apply.bench.crash import CrashDrill, load_table_differences
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from tests.test_crash import CRASH_TEST_KILLS
from tests.test_live import assert_delta_equals_postgres

pytestmark = pytest.mark.spark

TABLES = {"public.orders": ["id", "amount", "note", "n2"], "public.logbook": ["line"], "public.scratch": ["line"],
          "public.soft": ["id", "v"],
          "public.kinds": ["id", "ts", "tstz", "d", "n", "js", "nothing", "flag", "u"]}  # and arr, b: _assert_equal
# Every frame of two rows or more is staged as Parquet (apply/staging.py): these types make the trip
# through a Parquet file the client writes and the server reads (timestamp without a time zone, arrays,
# a column that is null in every row, numerics, bytes).
STAGING = {"staging_rows": 2}


@pytest.fixture(scope="module")
def connect(connect_with_s3):  # type: ignore[no-untyped-def]
    return connect_with_s3[0]  # the worker's Connect server (tests/conftest.py)


def _write_config(path: Path, conninfo: str, warehouse: Path, spark: dict[str, str], **sections: object) -> Path:
    path.write_text(json.dumps({
        "pipeline": "cx", "source": {"dsn": conninfo, "slot": "cx", "create_publication": True},
        "target": {"warehouse": str(warehouse), **STAGING, **sections.pop("target", {})},  # type: ignore[dict-item]
        "defaults": {"schema_policy": "evolve"}, "snapshot": {"range_pages": 2},
        "tables": {"public.soft": {"delete_mode": "soft"}, "public.hist": {"scd_type": 2}},
        "spark": spark, **sections}))
    return path


def _run(config: Path, *verb: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "cdc_apply.cli", *(verb or ("run", "--once")), "--config",
                             str(config)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def _workload(conn: psycopg.Connection, step: int) -> None:
    if step == 0:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2))")
        conn.execute("CREATE TABLE logbook (line text)")  # no key: insert-only
        conn.execute("CREATE TABLE scratch (line text)")  # no key, emptied by a truncate
        conn.execute("CREATE TABLE soft (id int PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE hist (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO orders SELECT g, g * 1.5 FROM generate_series(1, 2000) g")  # > 2 pages: Spark's tasks
        conn.execute("INSERT INTO logbook VALUES ('first'), ('first')")
        conn.execute("INSERT INTO scratch VALUES ('gone'), ('gone')")
        conn.execute("INSERT INTO soft SELECT g, 'v' || g FROM generate_series(1, 20) g")
        conn.execute("INSERT INTO hist VALUES (1, 'a'), (2, 'b')")
        conn.execute("CREATE TABLE kinds (id int PRIMARY KEY, ts timestamp, tstz timestamptz, d date, n numeric(20,5), "
                     "arr int[], js jsonb, b bytea, nothing text, flag boolean, u uuid)")
        conn.execute("INSERT INTO kinds SELECT g, timestamp '2024-02-29 23:59:59.123456' + g * interval '1 hour', "
                     "timestamptz '1999-12-31 23:00:00+05' - g * interval '1 minute', date '0001-01-01' + g * 400, "
                     "g * 12345.67891, ARRAY[g, NULL, -g], jsonb_build_object('k', g, 'l', ARRAY[g]), "
                     "decode(lpad(to_hex(g), 8, '0'), 'hex'), NULL, g % 2 = 0, gen_random_uuid() "
                     "FROM generate_series(1, 30) g")
        return
    conn.execute("UPDATE orders SET amount = amount + 1 WHERE id % 3 = 0")
    conn.execute("DELETE FROM orders WHERE id > 1990")
    conn.execute("ALTER TABLE orders ADD COLUMN note text")
    conn.execute("ALTER TABLE orders ADD COLUMN n2 int DEFAULT 7")  # earlier rows read 7: a backfill
    conn.execute("INSERT INTO orders VALUES (100000, 1, 'with a note', 3)")
    conn.execute("TRUNCATE logbook")
    conn.execute("INSERT INTO logbook VALUES ('second')")
    conn.execute("TRUNCATE scratch")  # nothing after it: the target is overwritten with no rows
    conn.execute("DELETE FROM soft WHERE id <= 5")
    conn.execute("UPDATE soft SET v = 'changed' WHERE id = 6")
    conn.execute("UPDATE hist SET v = 'a2' WHERE id = 1")
    conn.execute("DELETE FROM hist WHERE id = 2")
    conn.execute("UPDATE kinds SET ts = ts + interval '1 day', arr = arr || 9, n = -n WHERE id % 2 = 0")
    conn.execute("INSERT INTO kinds (id) SELECT g FROM generate_series(31, 40) g")  # every other column null
    conn.execute("DELETE FROM kinds WHERE id % 5 = 0")


def _assert_equal(spark, conn: psycopg.Connection, warehouse: Path) -> None:  # type: ignore[no-untyped-def]
    for name, columns in TABLES.items():
        truth = postgres_rows(conn, name, columns)
        where = "NOT _cdc_deleted" if name == "public.soft" else None
        got = delta_rows(spark, str(warehouse / name.replace(".", "/")), columns, source_types(conn, name), where=where)
        assert got == truth, f"{name}: {len(got)} rows in Delta, {len(truth)} in PostgreSQL"
    # An array and bytes, which the oracle's text rendering does not take, compared as Python values.
    kinds = spark.read.format("delta").load(str(warehouse / "public" / "kinds"))
    assert sorted((r.id, r.arr, None if r.b is None else bytes(r.b)) for r in kinds.select("id", "arr", "b").collect()) \
        == sorted(conn.execute("SELECT id, arr, b FROM kinds").fetchall())
    history = spark.read.format("delta").load(str(warehouse / "public" / "hist"))
    assert sorted((r.id, r.v, r._cdc_current) for r in history.collect()) == [
        (1, "a", False), (1, "a2", True), (2, "b", False)]


def _fence_commits(spark, table: Path) -> int:  # type: ignore[no-untyped-def]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect()
    return sum(1 for row in history if '"fence"' in (row.userMetadata or ""))


def _run_once(config: Path, spark) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """`run --once`: as a CLI process (its session from the config), or with ``spark``, the tests'
    classic session, in this process. Returns (rows copied into public.orders, batches applied)."""
    if spark is None:
        out = _run(config).stdout
        copied = re.search(r"snapshot public\.orders: (\d+) rows", out)
        return (int(copied.group(1)) if copied else 0), int(re.search(r"batches (\d+)", out).group(1))
    from cdc_apply.config import load_config
    from cdc_apply.pipeline import drain

    summary = drain(load_config(str(config)), spark)
    return (sum(s.rows for s in summary.snapshots if s.table == "public.orders"),
            sum(1 for b in summary.batches if b.transactions))


@pytest.mark.parametrize("mode", ["connect", "classic-public"])
def test_run_once_copies_streams_and_evolves_through_public_apis(mode, db18, spark, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On Connect as CLI processes; the public path of a classic session (``target.delta_internals:
    false``) in this process, on the tests' session."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = tmp_path / "wh"
    if mode == "connect":
        config = _write_config(tmp_path / "c.json", conninfo, warehouse, {"spark.remote": connect.url})
        session = None
    else:
        config = _write_config(tmp_path / "c.json", conninfo, warehouse, {}, target={"delta_internals": False})
        session = spark
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _workload(conn, 0)
        assert _run_once(config, session)[0] == 2000
        # The tables the first run applied through the applier (the small copies) are in its clean
        # stop's marker (``apply/fence.py``); orders, copied by Spark's tasks, is fenced at its first touch.
        clean = ["soft", "hist"]
        if mode == "connect":
            marker = json.loads((warehouse / "_cdc_apply" / "clean_stop" / "cx.json").read_text())
            assert {f"{warehouse}/public/{name}" for name in clean} <= {e["location"] for e in marker["fenced"]}, marker
        _workload(conn, 1)
        assert _run_once(config, session)[1] >= 1
        _assert_equal(spark, conn, warehouse)
        # After a clean stop the next client has nothing to fence: no empty commit moved a version on
        # in a table the marker named, though the run wrote to each.
        for name in clean:
            assert _fence_commits(spark, warehouse / "public" / name) == 0, name
        if mode == "connect":
            assert _fence_commits(spark, warehouse / "public" / "orders") == 1
        # Every commit is Delta's own writer's: no file appended outside it, none without its version.
        orders = spark.sql(f"DESCRIBE HISTORY delta.`{warehouse}/public/orders`").collect()
        assert {row.operation for row in orders} <= {"CREATE TABLE", "WRITE", "MERGE", "ADD COLUMNS",
                                                      "SET TBLPROPERTIES", "OPTIMIZE"}, orders
        if mode == "connect":  # a marker that is not cdc_apply's JSON: warned of, and replaced at the stop
            (warehouse / "_cdc_apply" / "clean_stop" / "cx.json").write_text("{not json")
        # A third run finds nothing new and applies nothing twice.
        assert _run_once(config, session) == (0, 0)
        if mode == "connect":
            assert "fenced" in json.loads((warehouse / "_cdc_apply" / "clean_stop" / "cx.json").read_text())
        assert len(spark.sql(f"DESCRIBE HISTORY delta.`{warehouse}/public/orders`").collect()) == len(orders)
        _assert_equal(spark, conn, warehouse)
        # Frames were staged (the folder is made by the first), and each file went once its command ran.
        staging = warehouse / "_cdc_apply" / "staging" / "cx"
        assert staging.is_dir() and not list(staging.iterdir())


# A user's own streaming query on a Connect session. Run in a process of its own: a Connect session
# switches pyspark's functions to Connect for the whole process (the tests' classic session included).
USER_QUERY = """
import sys
from pyspark.sql import SparkSession
from cdc_apply.spark import foreach_batch
from cdc_apply.config import load_config
from cdc_apply.spark.datasource import register
from cdc_apply.stream_job import source_options

config = load_config(sys.argv[1])
spark = SparkSession.builder.remote(sys.argv[2]).getOrCreate()
register(spark)
query = (spark.readStream.format("pgoutput").options(**source_options(config.source, 20000)).load()
         .writeStream.foreachBatch(foreach_batch(config)).option("checkpointLocation", sys.argv[3])
         .trigger(availableNow=True).start())
query.awaitTermination(300)
assert query.exception() is None, query.exception()
spark.stop()
"""


def test_foreach_batch_in_a_users_streaming_query_and_the_stream_verb(db18, spark, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``format("pgoutput")`` read by a Connect session, its micro-batches applied by ``foreach_batch``
    in the server's Python worker; then `cdc-apply stream` (available now) on the same slot."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = tmp_path / "wh"
    config = _write_config(tmp_path / "c.json", conninfo, warehouse, {"spark.remote": connect.url},
                           stream={"trigger": "available_now"})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _workload(conn, 0)
        _run(config)  # the copy
        _workload(conn, 1)
        result = subprocess.run([sys.executable, "-c", USER_QUERY, str(config), connect.url, str(tmp_path / "ckpt")],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        _assert_equal(spark, conn, warehouse)  # the workload's second step: applied by the query alone
        conn.execute("INSERT INTO orders VALUES (100001, 2, 'by the stream verb', 1)")
        conn.execute("INSERT INTO logbook VALUES ('third')")
        _run(config, "stream")
        _assert_equal(spark, conn, warehouse)


# A batch read of a capture by a Connect session: the change rows of one table, as classic reads them.
BATCH_READ = """
import json, sys
from cdc_apply.spark.session import build_spark_session
spark = build_spark_session({"spark.remote": sys.argv[1]})
rows = spark.read.format("pgoutput").option("table", "public.orders").load(sys.argv[2])
print("ROWS " + json.dumps(sorted([r.op, r.commit_lsn] for r in rows.select("op", "commit_lsn").collect())))
"""


def test_capture_replay_the_change_log_status_and_resync_on_connect(db18, spark, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The other verbs as Connect clients: `capture`, then `replay` of it into the targets (and the
    run after it, which reads the same changes from the slot, applies nothing twice), a batch ``format("pgoutput")`` read of the capture equal to
    classic's, `status`, `replay --changelog` rebuilding every table elsewhere (the copies' rows
    included: on Connect they go into the log by Delta's writer), and `resync`."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse, rebuilt, capture = tmp_path / "wh", tmp_path / "rebuilt", tmp_path / "step1.jsonl"
    config = _write_config(tmp_path / "c.json", conninfo, warehouse, {"spark.remote": connect.url},
                           changelog={"enabled": True})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _workload(conn, 0)
        conn.execute("CREATE TABLE fresh (id int PRIMARY KEY, v text)")  # empty at the copy: all in the log
        _run(config)  # the copy, into the targets and the change log
        _workload(conn, 1)
        conn.execute("INSERT INTO fresh SELECT g, 'v' || g FROM generate_series(1, 40) g")
        _run(config)
        # Captured and replayed: no ADD COLUMN ... DEFAULT, whose backfill needs the live source.
        conn.execute("UPDATE fresh SET v = 'changed' WHERE id % 4 = 0")
        conn.execute("DELETE FROM fresh WHERE id > 35")
        conn.execute("UPDATE orders SET amount = amount * 2 WHERE id < 50")
        conn.execute("DELETE FROM orders WHERE id BETWEEN 50 AND 60")
        conn.execute("INSERT INTO orders VALUES (100002, 5, 'captured', 1)")
        conn.execute("INSERT INTO logbook VALUES ('captured')")
        _run(config, "capture", "--out", str(capture))  # peeks: the slot keeps its position
        _run(config, "replay", str(capture))
        _assert_equal(spark, conn, warehouse)
        logbook = spark.read.format("delta").load(str(warehouse / "public" / "logbook")).count()
        _run(config)  # the same changes from the slot: into the change log, skipped by the targets
        _assert_equal(spark, conn, warehouse)
        assert spark.read.format("delta").load(str(warehouse / "public" / "logbook")).count() == logbook

        read = subprocess.run([sys.executable, "-c", BATCH_READ, connect.url, str(capture)],
                              capture_output=True, text=True, timeout=300)
        assert read.returncode == 0, read.stderr[-3000:]
        by_connect = json.loads(next(line for line in read.stdout.splitlines() if line.startswith("ROWS "))[5:])
        classic = spark.read.format("pgoutput").option("table", "public.orders").load(str(capture))
        assert by_connect == sorted([r.op, r.commit_lsn] for r in classic.select("op", "commit_lsn").collect())
        assert {op for op, _ in by_connect} >= {"U", "D", "I"}

        status = json.loads(_run(config, "status").stdout)
        assert {row["table"] for row in status["tables"] if row["applied_lsn"] is not None} >= set(TABLES)

        # The copies' rows went into the change log by Delta's writer (no files committed by Delta's
        # internal classes on Connect): every table is rebuilt from the log alone.
        _run(config, "replay", "--changelog", "--warehouse", str(rebuilt))
        _assert_equal(spark, conn, rebuilt)
        fresh = postgres_rows(conn, "public.fresh", ["id", "v"])
        assert len(fresh) == 35 and delta_rows(spark, str(rebuilt / "public" / "fresh"), ["id", "v"],
                                               source_types(conn, "public.fresh")) == fresh

        conn.execute("UPDATE orders SET note = 'resynced' WHERE id < 5")
        _run(config, "resync", "--table", "public.orders")
        _run(config)
        _assert_equal(spark, conn, warehouse)


def test_follow_changelog_and_trim_changelog_on_connect(db18, spark, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``changelog.targets: separate`` with Connect clients: `run --once` only appends to the log,
    `follow-changelog --once` brings every target equal to PostgreSQL from it, and `trim-changelog`
    removes the rows the targets hold, never past them (a row they do not hold yet stays)."""
    from cdc_apply.lsn import format_lsn, parse_lsn

    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = tmp_path / "wh"
    config = _write_config(tmp_path / "c.json", conninfo, warehouse, {"spark.remote": connect.url},
                           changelog={"enabled": True, "confirm_after": "changelog", "targets": "separate"})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _workload(conn, 0)
        _run(config)  # the copies: into the targets and the log
        _workload(conn, 1)
        _run(config)  # the changes: into the log only
        assert delta_rows(spark, str(warehouse / "public" / "soft"), ["id", "v"], source_types(conn, "public.soft"),
                          where="NOT _cdc_deleted") != postgres_rows(conn, "public.soft", ["id", "v"])
        followed = _run(config, "follow-changelog", "--once")
        assert re.search(r"follow-changelog: \d+ window\(s\), [1-9][\d,]* changes applied", followed.stdout), \
            followed.stdout
        _assert_equal(spark, conn, warehouse)

        log = spark.read.format("delta").load(str(warehouse / "_cdc_apply" / "changelog"))
        last = log.agg({"commit_lsn": "max"}).collect()[0][0]
        conn.execute("INSERT INTO logbook VALUES ('after the follow')")
        _run(config)  # in the log, not yet in the targets: the trim stops at what they hold
        trimmed = _run(config, "trim-changelog", "--through-lsn", "FFFFFFFF/FFFFFFFF")
        assert "trimming through that instead" in trimmed.stdout, trimmed.stdout
        through = re.search(r"trim-changelog: [1-9][\d,]* rows of transactions committed through (\S+) removed",
                            trimmed.stdout)
        assert through is not None, trimmed.stdout
        # The targets' position is the log's batches' version: the last commit LSN, or one past it when
        # the run fenced the log's writer identity after its last append (one past is no commit's LSN).
        assert parse_lsn(through[1]) in (last, last + 1), (through[1], format_lsn(last))
        log = spark.read.format("delta").load(str(warehouse / "_cdc_apply" / "changelog"))
        assert log.where(f"commit_lsn <= {last}").count() == 0 and log.where(f"commit_lsn > {last}").count() == 1


# Every failpoint of the stream: in CI the only drill that kills at the two before a write
# (after_receive, after_decode); the drill on S3 kills at the two after a commit (tests/test_crash.py).
CONNECT_FAILPOINTS = ("after_receive", "after_decode", "between_tables", "before_confirm")


@pytest.mark.crash
@pytest.mark.timeout(1200)
def test_kill_9_of_a_connect_client_under_load(db18, spark, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`run --follow` on a Connect session, killed at each failpoint and at random points: the server
    outlives each client; after each kill nothing is lost, and at the end no row is applied twice."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    drill = CrashDrill("follow", conninfo, tmp_path, kills=CRASH_TEST_KILLS, seed=55,
                       spark_conf={"spark.remote": connect.url}, failpoints=CONNECT_FAILPOINTS)
    drill.run()
    assert not drill.problems, drill.problems
    assert drill.failpoint_kills == len(CONNECT_FAILPOINTS) and drill.random_kills == CRASH_TEST_KILLS
    assert drill.load is not None and drill.load.committed > 30
    # A killed client leaves no clean-stop marker: each client after a failpoint's kill fenced the
    # ledger before it reached its own failpoint.
    assert _fence_commits(spark, Path(drill.warehouse) / "public" / "ledger") >= 3
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert_delta_equals_postgres(spark, conn, drill.warehouse)
        assert load_table_differences(spark, conn, drill.warehouse) == {}


ZOMBIE_CLIENT = """
import sys
from cdc_apply.spark.session import build_spark_session
spark = build_spark_session({"spark.remote": sys.argv[1]}, register_pgoutput=False)
slow = spark.range(0, 4, 1, 2).selectExpr("id", "CAST(reflect('java.lang.Thread', 'sleep', CAST(10000 AS BIGINT)) AS STRING) AS s")
print("writing", flush=True)
slow.write.format("delta").mode("append").option("txnAppId", "p/1").option("txnVersion", "7").save(sys.argv[2])
"""

RESTARTED_CLIENT = """
import sys
from cdc_apply.apply.targets import Target
from cdc_apply.spark.session import build_spark_session
spark = build_spark_session({"spark.remote": sys.argv[1]}, register_pgoutput=False)
Target(spark, sys.argv[2], False).fence("p/1")
print(Target(spark, sys.argv[2], False).committed_version("p/1"), flush=True)
"""


def test_a_killed_clients_commit_that_the_server_finishes_is_fenced_off(spark, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Connect client killed -9 in the middle of a commit: the server goes on with that commit (for
    a client that might reattach; executions that are not reattachable go on too). Without a fence,
    it landed seconds later, after a restarted pipeline had read the targets' versions, and an
    append's rows were applied twice (the Connect crash drill, once in four fresh-clone runs). The
    restarted client's fence (``Target.fence``, before its first read of each target) makes Delta fail
    the late commit; or, when the killed client's tasks hold the server's task slots until it
    commits (seen after the module's other tests), the fence follows that commit and the restarted
    client reads it. Either way nothing lands after the fence."""
    target = tmp_path / "t"
    spark.sql(f"CREATE TABLE delta.`{target}` (id BIGINT, s STRING) USING delta")
    Target(spark, str(target), False).record_version("p/1", 5, "{}")  # what the pipeline applied before
    zombie = subprocess.Popen([sys.executable, "-c", ZOMBIE_CLIENT, connect.url, str(target)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert zombie.stdout is not None and zombie.stdout.readline().strip() == "writing"
        time.sleep(3)  # the write's two tasks sleep 20 s each on the server
    finally:
        zombie.kill()
        zombie.wait()
    killed = time.monotonic()
    restarted = subprocess.run([sys.executable, "-c", RESTARTED_CLIENT, connect.url, str(target)],
                               capture_output=True, text=True, timeout=300)
    assert restarted.returncode == 0, restarted.stderr[:3000]
    read = restarted.stdout.split()  # the version the restarted client read, after its fence
    time.sleep(max(0.0, killed + 30 - time.monotonic()))  # past the end of the killed client's write
    commits = [path.read_text() for path in sorted((target / "_delta_log").glob("*.json"))]
    # Nothing lands after the fence: the killed client's commit failed (the fence one past the 5
    # applied before), or it had landed before the fence and the restarted client read it.
    assert read in (["6"], ["8"]), read
    assert f'"appId":"p/1","version":{read[0]}' in commits[-1]
    landed = [i for i, commit in enumerate(commits) if '"appId":"p/1","version":7' in commit]
    assert landed == ([] if read == ["6"] else [len(commits) - 2])
    assert spark.read.format("delta").load(str(target)).count() == (0 if read == ["6"] else 4)



@pytest.mark.pg
def test_bench_restart_times_a_restarted_run_to_its_first_change(connect, capsys) -> None:  # type: ignore[no-untyped-def]
    """`bench restart --connect`, one round, its Connect clients on this module's server (the CLI
    starts a server of its own)."""
    from cdc_apply.bench.restart import bench_restart

    result = bench_restart(rounds=1, mode="follow", connect=True, connect_url=connect.url)
    report = capsys.readouterr().out
    assert re.search(r"process start -> first new change applied: median [0-9.]+ s", report), report
    assert 0 < result["streaming_s"] <= result["applied_s"], report
    assert 0 < result["connect_streaming_s"] <= result["connect_applied_s"], report
    assert re.search(r"first new change applied, Connect / classic: [0-9.]+x", report), report
    assert f"Spark Connect clients of {connect.url}" in report, report
