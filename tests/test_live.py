"""`run --follow` over the walsender against a real server: a concurrent workload streamed into Delta,
a connection lost mid-stream, a server crash and restart under load, and an idle slot that keeps moving."""

from __future__ import annotations

import time

import psycopg
import pytest

from cdc_apply.bench.load import TABLES, Load, create_schema
from cdc_apply.config import parse_config
from cdc_apply.lake.location import Location
from cdc_apply.live import BackgroundReplicator
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgserver import PgServer, available_bindirs
from cdc_apply.sources.slot import wait_until_caught_up
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows


def live_config(conninfo: str, warehouse: str, **source: object):  # type: ignore[no-untyped-def]
    return parse_config({"pipeline": "live", "source": {"dsn": conninfo, "slot": "live", "publication": "load",
                                                        **source},
                         "target": {"warehouse": warehouse}, "batching": {"max_seconds": 1, "max_changes": 5000}})


def wait_for_slot(conninfo: str, slot: str, timeout: float = 180) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        deadline = time.monotonic() + timeout
        while not conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone():
            assert time.monotonic() < deadline, f"slot {slot} was not created"
            time.sleep(0.1)


def assert_delta_equals_postgres(spark, conn, warehouse: str, storage=None) -> None:  # type: ignore[no-untyped-def]
    """``storage``: how delta-rs reaches an object store's warehouse."""
    for name, columns in TABLES.items():
        truth = postgres_rows(conn, name, columns)
        got = delta_rows(spark, str(Location.parse(warehouse).child(*name.split("."))), columns,
                         source_types(conn, name), storage=storage)
        assert got == truth, f"{name}: {len(got)} rows in Delta, {len(truth)} in PostgreSQL"


def test_follow_streams_a_concurrent_workload_into_delta(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        config = live_config(conninfo, warehouse, two_phase=True)
        with BackgroundReplicator(config, spark) as follower:
            wait_for_slot(conninfo, "live")
            load = Load(conninfo, sessions=3, rate_per_session=40, big_every=60).start()
            time.sleep(8)
            conn.execute("BEGIN")
            conn.execute("INSERT INTO accounts VALUES (1, 'prepared', 1, NULL, now())")
            conn.execute("PREPARE TRANSACTION 'live1'")
            time.sleep(2)
            load.finish()
            conn.execute("COMMIT PREPARED 'live1'")
            wait_until_caught_up(conninfo, "live", timeout=300)
        summary = follower.replicator.summary
        assert load.committed > 300 and len(summary.batches) >= 3
        assert len(summary.lag_seconds) == load.committed + 1 and min(summary.lag_seconds) > 0
        print('batch seconds', [round(b.seconds, 1) for b in summary.batches])
        assert_delta_equals_postgres(spark, conn, warehouse)


@pytest.mark.pg
def test_follow_survives_connection_loss_and_a_server_crash_and_moves_an_idle_slot(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = PgServer(bindir=available_bindirs()["pg18"]).start()
    try:
        warehouse = str(tmp_path / "wh")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            create_schema(conn, "load")
        config = live_config(server.dsn, warehouse)
        with BackgroundReplicator(config, spark) as follower:
            wait_for_slot(server.dsn, "live")
            load = Load(server.dsn, sessions=2, rate_per_session=30, big_every=0).start()
            time.sleep(4)
            with psycopg.connect(server.dsn, autocommit=True) as conn:  # the connection drops mid-stream
                assert conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_replication").fetchall()
            time.sleep(3)
            server.restart(mode="immediate")  # a server crash under load: the slot may go back in time
            time.sleep(3)
            load.finish()
            assert load.reconnects >= 1
            load = Load(server.dsn, sessions=2, rate_per_session=30, big_every=0, seed=2).start()
            time.sleep(4)
            load.finish()
            wait_until_caught_up(server.dsn, "live", timeout=300)
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                # WAL from outside the publication: the idle slot follows it via keepalives.
                conn.execute("CREATE TABLE unpublished (a int); INSERT INTO unpublished SELECT generate_series(1, 1000)")
                target = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
                wait_until_caught_up(server.dsn, "live", timeout=300)
                confirmed = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots").fetchone()[0]
                assert parse_lsn(confirmed) >= target
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            assert_delta_equals_postgres(spark, conn, warehouse)
        assert follower.replicator.summary.reconnects >= 1  # one or two, depending on where each hit
    finally:
        server.stop()
