"""The warehouse on object storage, against a real S3-compatible server (versitygw) the tests start.

- The copy (Spark's tasks writing its files into the bucket) and the stream (`run --once` twice) with
  schema evolution, a truncate and a keyless table: every target equals PostgreSQL, read from S3 by
  Spark and by delta-rs; the pipeline's state lies in the bucket beside the targets, and nothing
  lands on the local disk; the change log, in the bucket, rebuilds every table; a resync.
- Two pipelines from two databases share one bucket; one that would write another's target is refused.
- kill -9 of `run --follow` under load (the failpoints after a commit); the S3 server stopped for a
  while mid-stream.
- `stream` with its checkpoint in the bucket.
- Bad input fails before Spark starts, naming the key, with no traceback and no secret.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.lake.location import Location
from cdc_apply.lake.state import PipelineState, TargetOwnedError, TargetRegistry
from cdc_apply.s3server import S3Server
from tests.conftest import fresh_database
from tests.delta_oracle import delta_rows, parquet_writers, source_types
from tests.reference_apply import postgres_rows
from tests.test_decode_cli import _cli

TABLES = {"public.orders": ["id", "amount", "note"], "public.events": ["id", "kind"], "public.logbook": ["line"],
          "public.later": ["id", "v"]}


# One server per test worker for the whole run, not per module: the S3 drill runs at the head of a
# worker (tests/conftest.py, LONGEST_FIRST), apart from the module's other tests, and the shared Spark
# session caches its S3A file system per bucket, with the endpoint (the port) it first reached.
@pytest.fixture(scope="session")
def s3():  # type: ignore[no-untyped-def]
    with S3Server() as server:
        server.create_bucket("lake")
        yield server


def test_a_started_s3_server_used_as_a_context_manager_is_not_started_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = S3Server().start()
    first = server._process
    with server:
        assert server._process is first  # the same process: a second one would leave the first running
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    assert first is not None and first.poll() is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def _config(server, dbname: str, s3: S3Server, pipeline: str, warehouse: str,  # type: ignore[no-untyped-def]
            changelog: bool = False):
    return parse_config({"pipeline": pipeline,
                         "source": {"dsn": server.conninfo(dbname), "slot": pipeline, "create_publication": True},
                         "target": {"warehouse": warehouse}, "defaults": {"schema_policy": "evolve"},
                         "changelog": {"enabled": changelog}, "spark": s3.spark_conf(),
                         "snapshot": {"range_pages": 4}})  # a table past 4 pages is copied by Spark's tasks


def _use_store(spark, s3: S3Server) -> None:  # type: ignore[no-untyped-def]
    """The shared test session reaches this server (a job's own session takes them from ``spark:``)."""
    for key, value in s3.spark_conf().items():
        spark.conf.set(key.removeprefix("spark.hadoop."), value)


def _assert_equal(spark, conn, warehouse: str, s3: S3Server, tables=TABLES) -> None:  # type: ignore[no-untyped-def]
    for name, columns in tables.items():
        truth = postgres_rows(conn, name, columns)
        path = str(Location.parse(warehouse).under(name.replace(".", "/")))
        got = delta_rows(spark, path, columns, source_types(conn, name), storage=s3.storage())
        assert got == truth, f"{name}: {len(got)} rows in Delta, {len(truth)} in PostgreSQL"


@pytest.mark.spark
def test_copy_and_stream_into_a_warehouse_on_s3(pg18, spark, s3, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from cdc_apply.apply.options import apply_options
    from cdc_apply.pipeline import drain
    from cdc_apply.replay import replay_changelog
    from cdc_apply.resync import published_oids, resync
    from cdc_apply.status import pipeline_status

    _use_store(spark, s3)
    monkeypatch.chdir(tmp_path)  # a path that lost its bucket would land here
    warehouse = "s3a://lake/wh"
    databases = fresh_database(pg18)
    server, dbname = next(databases)
    config = _config(server, dbname, s3, "orders_db", warehouse, changelog=True)
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2))")
        conn.execute("CREATE TABLE events (id bigint PRIMARY KEY, kind text)")
        conn.execute("CREATE TABLE logbook (line text)")  # no key: insert-only
        conn.execute("INSERT INTO orders SELECT g, g * 1.5 FROM generate_series(1, 3000) g")
        conn.execute("INSERT INTO events SELECT g, 'e' || g FROM generate_series(1, 50) g")
        conn.execute("INSERT INTO logbook VALUES ('first'), ('first')")
        conn.execute("CREATE TABLE later (id int PRIMARY KEY, v text)")  # empty at the copy: all its rows in the log
        first = drain(config, spark)  # copies the tables: Spark's tasks write the files into the bucket themselves
        assert sorted(s.table for s in first.snapshots) == sorted(TABLES)
        assert {s.table for s in first.snapshots if s.method == "ranges"} == {"public.orders"}
        # versitygw keeps the bucket as a directory: the copy's files are pyarrow's, not Spark's writer's
        assert parquet_writers(str(s3.root / "lake" / "wh" / "public" / "orders")) == {"parquet-cpp-arrow"}

        conn.execute("UPDATE orders SET amount = amount + 1 WHERE id % 3 = 0")
        conn.execute("DELETE FROM orders WHERE id > 2990")
        conn.execute("ALTER TABLE orders ADD COLUMN note text")  # schema evolution
        conn.execute("INSERT INTO orders VALUES (100000, 1, 'with a note')")
        conn.execute("TRUNCATE events")
        conn.execute("INSERT INTO events VALUES (7, 'after the truncate')")
        conn.execute("INSERT INTO logbook VALUES ('second')")
        conn.execute("INSERT INTO later SELECT g, 'v' || g FROM generate_series(1, 30) g")
        conn.execute("UPDATE later SET v = 'changed' WHERE id % 4 = 0")
        second = drain(config, spark)
        assert second.batches
        _assert_equal(spark, conn, warehouse, s3)

        # The change log, in the bucket, holds the copies' rows too (the tasks wrote them there with the
        # config's S3 settings): it rebuilds every target elsewhere in the bucket.
        replay_changelog(spark, config, replace(apply_options(config), warehouse="s3a://lake/rebuilt"))
        _assert_equal(spark, conn, "s3a://lake/rebuilt", s3)
        # A resync copies a table again (its mark in the bucket while it runs), under new changes.
        conn.execute("UPDATE orders SET note = 'resynced' WHERE id < 5")
        resync(config, spark, published_oids(config, ["public.orders"]))
        drain(config, spark)
        _assert_equal(spark, conn, warehouse, s3)

    storage = s3.storage()
    state = PipelineState.at(warehouse, config.pipeline, storage)
    registry = TargetRegistry(state).entries()
    assert status_has_changelog(pipeline_status(config))
    assert sorted(e["location"] for e in registry.values()) == [
        "s3a://lake/wh/public/events", "s3a://lake/wh/public/later", "s3a://lake/wh/public/logbook",
        "s3a://lake/wh/public/orders"]
    assert (s3.root / "lake" / "wh" / "_cdc_apply" / "targets" / "orders_db.json").exists()
    assert not any(p.name.startswith("s3a") for p in Path(tmp_path).rglob("*")), "state written to the local disk"
    status = pipeline_status(config)
    assert {row["table"]: row["applied_lsn"] is not None for row in status["tables"]} == {
        name: True for name in TABLES}
    assert s3.secret_key not in json.dumps(status)

    # A second database, its own pipeline, the same bucket: beside the first, not in its way.
    other_databases = fresh_database(pg18)  # kept: the database is dropped when its generator goes
    other_server, other_db = next(other_databases)
    other = _config(other_server, other_db, s3, "other_db", "s3a://lake/wh2")
    with psycopg.connect(other_server.conninfo(other_db), autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text)")
        conn.execute("INSERT INTO orders VALUES (1, 2, 'other')")
        drain(other, spark)
        truth = postgres_rows(conn, "public.orders", TABLES["public.orders"])
        assert delta_rows(spark, "s3a://lake/wh2/public/orders", TABLES["public.orders"],
                          source_types(conn, "public.orders"), storage=storage) == truth
    # ... and pointed at the first pipeline's warehouse, it is refused before it writes a target.
    clash = _config(other_server, other_db, s3, "clash", warehouse)
    with psycopg.connect(other_server.conninfo(other_db), autocommit=True) as conn:
        conn.execute("INSERT INTO orders VALUES (2, 3, 'clash')")
    with pytest.raises(TargetOwnedError, match="pipeline 'orders_db' writes"):
        drain(clash, spark)
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        _assert_equal(spark, conn, warehouse, s3)  # the first pipeline's targets untouched


def status_has_changelog(status: dict) -> bool:  # type: ignore[type-arg]
    """`status` read the change log's position from the bucket."""
    return status["changelog"]["lsn"] is not None and status["changelog"]["location"].startswith("s3a://lake/wh/")


def _write_config(path: Path, s3: S3Server, warehouse: str, **spark: str) -> Path:
    conf = {**s3.spark_conf(), **spark}
    lines = ["pipeline: p", "source:", "  dsn: postgresql://127.0.0.1:1/none", "target:", f"  warehouse: {warehouse}",
             "spark:", *(f"  {key}: {json.dumps(value)}" for key, value in conf.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("warehouse,spark_conf,expected", [
    ("s3a://no-such-bucket/wh", {}, "target.warehouse s3a://no-such-bucket/wh: bucket 'no-such-bucket' does not exist"),
    ("s3a://lake/wh", {"spark.hadoop.fs.s3a.secret.key": "wrong-secret-0123"},
     "target.warehouse s3a://lake/wh: the store refused the request"),
])
def test_a_warehouse_the_store_refuses_fails_before_spark_starts(s3, tmp_path, warehouse, spark_conf,
                                                                 expected) -> None:  # type: ignore[no-untyped-def]
    config = _write_config(tmp_path / "c.yaml", s3, warehouse, **spark_conf)
    result = _cli("run", "--once", "--config", str(config))
    assert result.returncode != 0 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    for secret in (s3.secret_key, "wrong-secret-0123"):
        assert secret not in result.stderr + result.stdout


def test_a_path_template_that_would_leave_an_s3_warehouse_is_refused(s3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _write_config(tmp_path / "c.yaml", s3, "s3a://lake/wh")
    config.write_text(config.read_text().replace("target:\n", "target:\n  path_template: '../{schema}/{table}'\n"))
    result = _cli("validate", str(config))
    assert result.returncode != 0 and "target.path_template" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and s3.secret_key not in result.stderr
    assert not os.path.exists(tmp_path / "s3a:")


def test_the_pipelines_own_reads_and_writes_ride_out_the_store_away_and_fail_at_once_on_a_refusal(s3) -> None:  # type: ignore[no-untyped-def]
    """Python's requests (the state, the targets' logs) wait out an outage as S3A's do, on S3A's own
    retry settings; a refused credential is not asked again."""
    import threading

    from cdc_apply.lake.location import Storage, StorageError

    storage = Storage.from_spark_conf({**s3.spark_conf(), "spark.hadoop.fs.s3a.retry.interval": "200ms"})
    assert storage.retry_delays() == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8]
    document = Location.parse("s3a://lake/retries/state.json")
    storage.write_text(document, "before")
    s3.stop()
    restart = threading.Timer(3, s3.start)
    restart.start()
    try:
        started = time.monotonic()
        storage.write_text(document, "during")  # asked until the store is back
        assert time.monotonic() - started >= 2.5
        assert storage.read_text(document) == "during"
        assert list(storage.names(Location.parse("s3a://lake/retries"))) == ["state.json"]
    finally:
        restart.join()
    refused = Storage.from_spark_conf({**s3.spark_conf(), "spark.hadoop.fs.s3a.secret.key": "wrong-secret-0123"})
    started = time.monotonic()
    with pytest.raises(StorageError, match="s3a://lake/retries/state.json: cannot read") as error:
        refused.read_text(document)
    assert time.monotonic() - started < 2 and "wrong-secret-0123" not in str(error.value)
    with pytest.raises(StorageError, match="spark.hadoop.fs.s3a.retry.interval 'soon': not a duration"):
        Storage.from_spark_conf({"spark.hadoop.fs.s3a.retry.interval": "soon"}).retry_delays()
    with pytest.raises(StorageError, match="spark.hadoop.fs.s3a.retry.limit 'many': not a whole number"):
        Storage.from_spark_conf({"spark.hadoop.fs.s3a.retry.limit": "many"}).retry_delays()


# The failpoints after a commit to the bucket, with the slot not yet confirmed. The two before any
# write (after_receive, after_decode: the driver's loop, the same code whatever the session or the
# store) are killed by the Connect drill, which kills at all four and at random; `run --follow` is
# killed at random on a classic session by the change log's drill (docs/testing.md). No random kill
# here; `cdc-apply bench crash --warehouse local-s3 --kills 20` is the soak.
S3_FAILPOINTS = ("between_tables", "before_confirm")


@pytest.mark.crash
@pytest.mark.timeout(1800)
def test_kill_9_of_run_follow_under_load_with_the_warehouse_on_s3(db18, spark, s3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The follow drill (cdc_apply/bench/crash.py) with every target and the state in the bucket: 0
    lost, 0 applied twice after each kill (at the failpoints after a commit to the bucket), and every
    table equal to PostgreSQL."""
    from cdc_apply.bench.crash import CrashDrill, load_table_differences
    from tests.test_live import assert_delta_equals_postgres

    _use_store(spark, s3)
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    drill = CrashDrill("follow", conninfo, tmp_path, kills=0, seed=54, warehouse_uri="s3a://lake/crash",
                       spark_conf=s3.spark_conf(), failpoints=S3_FAILPOINTS)
    drill.run()
    assert not drill.problems, drill.problems
    assert drill.failpoint_kills == len(S3_FAILPOINTS) and drill.random_kills == 0
    assert drill.load is not None and drill.load.committed > 30
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert_delta_equals_postgres(spark, conn, drill.warehouse, storage=s3.storage())
        assert load_table_differences(spark, conn, drill.warehouse) == {}
    assert not (tmp_path / "wh").exists()


@pytest.mark.spark
def test_run_follow_rides_out_the_s3_server_stopped_mid_stream(db18, spark, s3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The store goes away for 8 s under load: what S3A's retries do not ride out, the pipeline does (a
    failed write is tried again from the confirmed position), the slot is not confirmed while nothing
    can become durable, and when the store is back the pipeline carries on with nothing lost and
    nothing applied twice. Then, with ``batching.write_retry_seconds: 1``, an outage stops the run
    with the write's error and confirms nothing, and the next run carries on."""
    from cdc_apply.bench.crash import confirmed_lsn, lost_from_targets
    from cdc_apply.bench.load import Load, create_schema
    from cdc_apply.live import BackgroundReplicator, WriteFailed
    from cdc_apply.sources.slot import current_wal_lsn
    from tests.test_live import assert_delta_equals_postgres, wait_for_slot

    _use_store(spark, s3)
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = "s3a://lake/outage"
    settings = {"pipeline": "outage", "source": {"dsn": conninfo, "slot": "crash", "publication": "load"},
                "target": {"warehouse": warehouse}, "batching": {"max_seconds": 1, "max_changes": 5000},
                "spark": s3.spark_conf()}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        with BackgroundReplicator(parse_config(settings), spark) as follower:
            wait_for_slot(conninfo, "crash")
            load = Load(conninfo, sessions=2, rate_per_session=20, big_every=0).start()
            time.sleep(6)
            s3.stop()
            try:
                time.sleep(2)  # a commit under way when the store went settles (it cannot finish)
                during = confirmed_lsn(conn)
                time.sleep(6)
                assert confirmed_lsn(conn) == during, "the slot moved while the store was down"
            finally:
                s3.start()
            time.sleep(4)
            load.finish()
            follower.wait_caught_up(timeout=180)
            assert follower.thread.is_alive(), follower.error
        assert not lost_from_targets(conn, load, warehouse, s3.storage())
        assert load.committed > 100

        # cdc_apply's own requests give up after one retry too (S3A's retries stay the session's).
        settings["batching"] = {**settings["batching"], "write_retry_seconds": 1}
        settings["spark"] = {**s3.spark_conf(), "spark.hadoop.fs.s3a.retry.limit": "1"}
        impatient = BackgroundReplicator(parse_config(settings), spark).start()
        try:
            # Caught up past a new row: the run is streaming (its start, which reads the store, is over).
            conn.execute("INSERT INTO accounts (id, balance, owner) VALUES (-2, 0, 'before')")
            impatient.wait_caught_up(timeout=120)
            s3.stop()
            try:
                conn.execute("INSERT INTO accounts (id, balance, owner) VALUES (-1, 0, 'away')")
                inserted = current_wal_lsn(conn)
                impatient.thread.join(180)
                assert not impatient.thread.is_alive(), "the run went on with the store away"
                assert confirmed_lsn(conn) < inserted, "the slot was confirmed past a write that failed"
            finally:
                s3.start()
        finally:
            impatient.stop.event.set()
            impatient.thread.join(60)
        assert isinstance(impatient.error, WriteFailed), impatient.error
        assert "batching.write_retry_seconds 1" in str(impatient.error), impatient.error
        with BackgroundReplicator(parse_config(settings), spark) as after:
            after.wait_caught_up(timeout=120)
        assert_delta_equals_postgres(spark, conn, warehouse, storage=s3.storage())


@pytest.mark.spark
def test_the_streaming_query_checkpoints_and_applies_on_s3(db18, spark, s3) -> None:  # type: ignore[no-untyped-def]
    """`cdc-apply stream` (available_now) twice: its checkpoint in the bucket carries the second run on
    from where the first stopped, and every target, in the bucket, equals PostgreSQL."""
    from cdc_apply.runtime import StopFlag
    from cdc_apply.stream_job import checkpoint_location, run_stream

    _use_store(spark, s3)
    server, dbname = db18
    warehouse = "s3a://lake/streamed"
    config = parse_config({"pipeline": "streamed", "source": {"dsn": server.conninfo(dbname), "slot": "streamed",
                                                               "create_publication": True},
                           "target": {"warehouse": warehouse}, "stream": {"trigger": "available_now"},
                           "spark": s3.spark_conf()})
    tables = {"public.items": ["id", "v"]}
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        run_stream(config, spark, StopFlag())  # creates the publication and the slot (the stream copies nothing)
        conn.execute("INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 100) g")
        assert sum(p["numInputRows"] for p in run_stream(config, spark, StopFlag())) == 100
        conn.execute("UPDATE items SET v = 'second' WHERE id <= 10")
        conn.execute("DELETE FROM items WHERE id > 90")
        second = run_stream(config, spark, StopFlag())
        assert sum(p["numInputRows"] for p in second) == 20  # only what came after the first run
        _assert_equal(spark, conn, warehouse, s3, tables)
    assert checkpoint_location(config) == "s3a://lake/streamed/_cdc_apply/checkpoints/streamed"
    assert (s3.root / "lake" / "streamed" / "_cdc_apply" / "checkpoints" / "streamed" / "offsets").is_dir()
