"""Initial snapshot against a real server: existing rows copied at an exported snapshot while writes
go on, then the slot's changes on top (nothing lost, nothing twice); a table added to the
publication later gets its own snapshot; publication row filters and column lists are honoured;
a copy killed half-way resumes (Spark's ranges, or the driver's key order)."""

from __future__ import annotations

import json
import logging
import signal
import time

import psycopg
import pytest

from cdc_apply.apply.targets import Target
from cdc_apply.bench.load import TABLES, Load, create_schema
from cdc_apply.config import load_config, parse_config
from cdc_apply.lsn import parse_lsn
from cdc_apply.pipeline import drain
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from cdc_apply.bench.crash import Job
from tests.test_live import assert_delta_equals_postgres

PREFILL = """
INSERT INTO accounts SELECT g, 'owner' || g % 50, g / 7.0, CASE WHEN g % 1000 = 0 THEN repeat(md5(g::text), 300) END,
       '2026-01-01'::timestamptz + g * interval '1 minute' FROM generate_series(1, 20000) g;
INSERT INTO ledger (session, account, amount) SELECT 9, g, g FROM generate_series(1, 3000) g;
INSERT INTO journal SELECT 9, g, NULL FROM generate_series(1, 500) g;
"""


# Small ranges and commits, so that these tables' copies take several of each.
SMALL_RANGES = {"chunk_rows": 4000, "range_pages": 20, "ranges_per_commit": 2}


def _config(conninfo: str, warehouse: str, **snapshot: object):  # type: ignore[no-untyped-def]
    return parse_config({"pipeline": "snap", "source": {"dsn": conninfo, "slot": "snap", "publication": "load"},
                         "target": {"warehouse": warehouse}, "snapshot": SMALL_RANGES | snapshot})


def test_snapshot_under_writes_then_stream_and_a_table_added_later(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = _config(conninfo, warehouse)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute(PREFILL)
        load = Load(conninfo, sessions=2, rate_per_session=20, big_every=50).start()
        try:
            time.sleep(1)
            first = drain(config, spark)  # creates the slot, copies 4 tables while the load writes
        finally:
            load.finish()
        assert {s.table for s in first.snapshots} == set(TABLES)
        assert next(s for s in first.snapshots if s.table == "public.accounts").rows >= 20000
        drain(config, spark)
        assert_delta_equals_postgres(spark, conn, warehouse)
        history = Target(spark, f"{warehouse}/public/accounts", False).history()
        copies = [json.loads(h.userMetadata)["copy"] for h in history if '"snapshot"' in (h.userMetadata or "")]
        assert len(copies) >= 3 and all(c["method"] == "ranges" for c in copies)  # 100+ pages, 40 per commit

        # A table joins the publication later, with rows, a row filter and a column list.
        conn.execute("CREATE TABLE late (id int PRIMARY KEY, region text, secret text, v int)")
        conn.execute("INSERT INTO late SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, 'x', g "
                     "FROM generate_series(1, 900) g")
        conn.execute("ALTER PUBLICATION load ADD TABLE late (id, region, v) WHERE (id % 3 = 0)")
        conn.execute("UPDATE late SET v = -v WHERE id <= 30")
        conn.execute("INSERT INTO late VALUES (1002, 'eu', 'y', 1), (1001, 'us', 'y', 1)")
        again = drain(config, spark)
        assert [s.table for s in again.snapshots] == ["public.late"]
        truth = [row for row in postgres_rows(conn, "public.late", ["id", "region", "v"]) if int(row[0]) % 3 == 0]
        got = delta_rows(spark, f"{warehouse}/public/late", ["id", "region", "v"], source_types(conn, "public.late"))
        assert got == truth and len(got) == 301
        assert "secret" not in Target(spark, f"{warehouse}/public/late", False).column_types()
        assert not drain(config, spark).snapshots


@pytest.mark.crash
def test_a_parallel_copy_killed_half_way_resumes_where_it_stopped(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Spark's tasks copy 20-page ranges, one commit each; a kill -9 after two commits; the rerun copies
    the other ranges from a new snapshot, merged by key, and the changes made in between (to rows
    copied before and after the kill, and new rows) land once."""
    # The rerun commits the 8 ranges left in one MERGE: where it resumes does not depend on its commits.
    _killed_copy_resumes(db18, spark, tmp_path, caplog, {"method": "spark", "range_pages": 20, "ranges_per_commit": 1},
                         "after range [0, 40]", rerun={"method": "spark", "range_pages": 20})


@pytest.mark.crash
def test_a_driver_copy_killed_half_way_resumes_after_its_last_key(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """snapshot.method driver: one COPY in key order, 5,000-row commits; the rerun resumes after the last key."""
    _killed_copy_resumes(db18, spark, tmp_path, caplog, {"method": "driver", "chunk_rows": 5000},
                         "after key ['10000'] (10000 rows copied)")


def _killed_copy_resumes(db, spark, tmp_path, caplog, snapshot: dict[str, object], resumed: str,  # type: ignore[no-untyped-def]
                         rerun: dict[str, object] | None = None) -> None:
    """``snapshot``: the killed copy's settings; ``rerun``: the resumed copy's (default the same). The
    killed copy is a `run --once` process; the rerun runs in this process (a new JVM costs about 20 s)."""
    server, dbname = db
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config_path, rerun_path = tmp_path / "snap.yaml", tmp_path / "snap-rerun.yaml"
    for path, settings in ((config_path, snapshot), (rerun_path, rerun or snapshot)):
        path.write_text(json.dumps({
            "pipeline": "snap", "source": {"dsn": conninfo, "slot": "snap", "publication": "load"},
            "target": {"warehouse": warehouse}, "snapshot": settings}))
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute(PREFILL)
        job = Job(config_path, tmp_path / "job.log", failpoint="snapshot_chunk:2", once=True)
        assert job.wait(timeout=300) == -signal.SIGKILL
        partial = Target(spark, f"{warehouse}/public/accounts", False)
        copied = partial.read().count()
        assert partial.exists() and 0 < copied < 20000  # two commits landed
        assert partial.committed_version("snap/" + str(conn.execute(
            "SELECT 'accounts'::regclass::oid").fetchone()[0])) is None
        conn.execute("DELETE FROM accounts WHERE id % 10 = 0")
        conn.execute("UPDATE accounts SET owner = 'moved' WHERE id % 7 = 0")
        conn.execute("INSERT INTO accounts (id, owner, balance) SELECT g, 'new', 1 FROM generate_series(30001, 30500) g")
        caplog.set_level(logging.INFO, logger="cdc_apply")
        drain(load_config(str(rerun_path)), spark)
        assert f"resuming the copy of public.accounts {resumed}" in caplog.text
        history = partial.history()
        assert not any(h.operation == "DELETE" for h in history)  # nothing copied twice: no clear
        assert_delta_equals_postgres(spark, conn, warehouse)
        # Rows copied before and after the kill, unchanged since, carry the copy's version: the first
        # snapshot's point, which the "snapshot complete" commit records.
        complete = next(json.loads(h.userMetadata) for h in history
                        if h.userMetadata and '"snapshot complete"' in h.userMetadata)
        untouched = partial.read().where("id <= 30000 AND id % 7 <> 0").select("_cdc_commit_lsn").distinct().collect()
        assert [r._cdc_commit_lsn for r in untouched] == [parse_lsn(complete["consistent_lsn"]) - 1]


def test_a_partitioned_table_published_via_its_root_is_copied_whole(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    columns = ["id", "region", "v"]
    config = parse_config({"pipeline": "parts", "source": {"dsn": conninfo, "slot": "parts", "publication": "parts"},
                           "target": {"warehouse": warehouse}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int, region text, v int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);"
                     "CREATE TABLE m_eu PARTITION OF m FOR VALUES IN ('eu');"
                     "CREATE TABLE m_us PARTITION OF m FOR VALUES IN ('us');"
                     "INSERT INTO m SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g FROM generate_series(1, 100) g;"
                     "CREATE PUBLICATION parts FOR TABLE m WITH (publish_via_partition_root = true)")
        assert [(s.table, s.rows) for s in drain(config, spark).snapshots] == [("public.m", 100)]
        conn.execute("UPDATE m SET v = -v WHERE id <= 10; DELETE FROM m WHERE id > 90; INSERT INTO m VALUES (500, 'eu', 5)")
        drain(config, spark)
        truth = postgres_rows(conn, "public.m", columns)
        got = delta_rows(spark, f"{warehouse}/public/m", columns, source_types(conn, "public.m"))
        assert got == truth and len(got) == 91


def test_a_column_added_while_the_export_waits_is_copied(any_db, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The copy's column list is read inside the exported snapshot: an ADD COLUMN that commits while
    the export waits for a running transaction is in the snapshot, and its values are copied (the
    ADD COLUMN DEFAULT backfill must not write the default over them)."""
    import threading

    from cdc_apply.sources.slot import create_slot

    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "race", "source": {"dsn": conninfo, "slot": "race", "publication": "p"},
                           "target": {"warehouse": warehouse}})
    with psycopg.connect(conninfo, autocommit=True) as conn, psycopg.connect(conninfo) as holder:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE other (id int)")
        conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        create_slot(conn, "race")
        holder.execute("INSERT INTO other VALUES (1)")  # a running transaction with an xid: the export waits
        result: list[object] = []
        copying = threading.Thread(target=lambda: result.append(drain(config, spark)), daemon=True)
        copying.start()
        deadline = time.monotonic() + 180
        while not conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name LIKE 'cdc_apply_snapshot_%'"
                               ).fetchone():
            assert time.monotonic() < deadline and copying.is_alive()
            time.sleep(0.1)
        conn.execute("ALTER TABLE t ADD COLUMN c text NOT NULL DEFAULT 'd', ADD COLUMN c2 text")
        conn.execute("UPDATE t SET c = 'x', c2 = 'y' WHERE id = 1")
        holder.commit()
        copying.join(120)
        assert result and not copying.is_alive()
        drain(config, spark)
        columns = ["id", "v", "c", "c2"]
        assert delta_rows(spark, f"{warehouse}/public/t", columns, source_types(conn, "public.t")) == \
            postgres_rows(conn, "public.t", columns) == [("1", "a", "x", "y"), ("2", "b", "d", None)]


def test_a_lost_exported_snapshot_fails_the_copy_clearly_and_the_rerun_resumes(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The connection holding the exported snapshot dies after Spark's copy committed two ranges: the
    next range's task cannot join the snapshot, and the run stops naming it (``SnapshotLost``); the
    rerun resumes from a new snapshot, after the ranges committed, and ends equal to PostgreSQL."""
    import threading

    import pytest

    from cdc_apply.sources.exported_snapshot import SnapshotLost

    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = _config(conninfo, warehouse, range_pages=10, ranges_per_commit=1, parallelism=1)
    log = tmp_path / "wh" / "public" / "accounts" / "_delta_log"
    ended: list[int] = []

    def end_the_export_after_two_ranges() -> None:
        deadline = time.monotonic() + 300
        with psycopg.connect(conninfo, autocommit=True) as admin:
            while time.monotonic() < deadline and not ended:
                # A range's commit: its userMetadata, escaped in the log's JSON, holds "method": "ranges".
                if log.exists() and sum('ranges\\"' in p.read_text() for p in log.glob("*.json")) >= 2:
                    ended.extend(pid for (pid,) in admin.execute(
                        "SELECT pg_terminate_backend(active_pid)::int FROM pg_replication_slots "
                        "WHERE slot_name LIKE 'cdc_apply_snapshot_%' AND active_pid IS NOT NULL").fetchall())
                time.sleep(0.05)

    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute(PREFILL)
        killer = threading.Thread(target=end_the_export_after_two_ranges)
        killer.start()
        try:
            with pytest.raises(SnapshotLost, match=r"the exported snapshot .* is gone \(its connection ended\) before "
                                                   r"COPY of public.accounts \(public.accounts pages \d+\.\."):
                drain(config, spark)
        finally:
            killer.join()
        assert ended
        conn.execute("UPDATE accounts SET owner = 'after' WHERE id % 9 = 0")
        resumed = drain(config, spark)
        assert [s.table for s in resumed.snapshots][0] == "public.accounts"
        drain(config, spark)
        assert_delta_equals_postgres(spark, conn, warehouse)
        history = Target(spark, f"{warehouse}/public/accounts", False).history()
        assert not any(h.operation == "DELETE" for h in history) and any(h.operation == "MERGE" for h in history)
