"""A failover on PostgreSQL 18: a primary, a physical standby that synchronizes the pipeline's
failover slot, a crash of the primary and a promotion. ``source.dsn`` lists both hosts with
``target_session_attrs=read-write``: the next run finds the new primary and its synced slot, the
transactions the synced slot sends again are skipped by the targets' versions, and every target
equals the new primary (read by Spark and delta-rs), the keyless table showing nothing twice. A
pipeline with an ordinary slot stops with the recovery named, and that recovery ends equal."""

from __future__ import annotations

import time

import psycopg
import pytest

from cdc_apply.bench.failover import FAILURES, FailoverDrill, drill_failovers, print_failover_report, wait_for
from cdc_apply.config import parse_config
from cdc_apply.live import BACKOFF_START_S, BackgroundReplicator
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgserver import PgServer, available_bindirs
from cdc_apply.pipeline import drain
from cdc_apply.resync import published_oids, resync
from cdc_apply.sources.health import HealthMonitor, missing_standby_slots
from cdc_apply.sources.preflight import PreflightError
from cdc_apply.sources.slot import create_slot
from cdc_apply.status import pipeline_status
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from tests.test_live import assert_delta_equals_postgres
from tests.tcp_proxy import StallingProxy

TABLES = {"public.accounts": ["id", "balance"], "public.journal": ["n", "note"]}


def _synced_up_to(standby: PgServer, primary: PgServer, slot: str) -> bool:
    """The standby's copy of the slot is synchronized and at the primary's confirmed position."""
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        wanted = conn.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                              (slot,)).fetchone()
    with psycopg.connect(standby.dsn, autocommit=True) as conn:
        copy = conn.execute("SELECT synced, confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                            (slot,)).fetchone()
    return copy is not None and copy[0] and copy[1] == wanted[0]


@pytest.mark.spark
@pytest.mark.timeout(600)
@pytest.mark.pg
@pytest.mark.crash
def test_a_promoted_standby_carries_the_failover_slot_on_exactly_once(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    primary = PgServer(bindir=available_bindirs()["pg18"]).start()
    standby = PgServer(bindir=primary.bindir)
    try:
        standby.start_standby_of(primary, "standby1")
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int)")
            conn.execute("CREATE TABLE journal (n int, note text)")
            conn.execute("ALTER TABLE journal REPLICA IDENTITY NOTHING")
            conn.execute("CREATE PUBLICATION pub FOR TABLE accounts, journal")
            conn.execute("INSERT INTO accounts SELECT g, 100 FROM generate_series(1, 20) g")
        both = (f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} user=postgres dbname=postgres "
                "target_session_attrs=read-write")
        warehouse = str(tmp_path / "wh")
        config = parse_config({"pipeline": "fo", "source": {"dsn": both, "slot": "fo", "publication": "pub"},
                               "target": {"warehouse": warehouse}})
        drain(config, spark)  # the copy, and the slot created as a failover slot
        plain_warehouse = str(tmp_path / "plain")
        plain = parse_config({"pipeline": "plain", "source": {"dsn": both, "slot": "plain", "publication": "pub",
                                                              "failover": False},
                              "target": {"warehouse": plain_warehouse}})
        drain(plain, spark)  # an ordinary slot: the standby keeps no copy of it

        def work(conn: psycopg.Connection, n: int) -> None:
            conn.execute("UPDATE accounts SET balance = balance + %s WHERE id %% 4 = %s", (n, n % 4))
            conn.execute("INSERT INTO journal VALUES (%s, 'entry')", (n,))

        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            for n in range(1, 6):
                work(conn, n)
        drain(config, spark)
        wait_for("the standby's synced slot", lambda: _synced_up_to(standby, primary, "fo"), poll=0.3)
        status = pipeline_status(config)["slot"]
        assert (status["failover"], status["synced"]) == (True, False)  # the primary's own slot
        [copy] = status["standby_copies"]
        assert (copy["server"], copy["in_recovery"], copy["synced"], copy["temporary"]) == \
            (f"127.0.0.1:{standby.port}", True, True, False)
        with psycopg.connect(standby.dsn, autocommit=True) as conn:  # the standby's copy stays here
            conn.execute("ALTER SYSTEM SET sync_replication_slots = off")
            conn.execute("SELECT pg_reload_conf()")
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            for n in range(6, 10):  # committed, replicated to the standby, not yet applied
                work(conn, n)
            lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        wait_for("the standby's replay", lambda: psycopg.connect(standby.dsn, autocommit=True).execute(
            "SELECT pg_last_wal_replay_lsn() >= %s", (lsn,)).fetchone()[0], poll=0.3)
        # A run applies them, but the standby's copy of the slot is behind: the new primary sends
        # them again, and the targets' versions skip them.
        applied = drain(config, spark).confirmed_lsn
        primary.halt()
        standby.promote()
        with psycopg.connect(standby.dsn, autocommit=True) as conn:
            wait_for("the promotion", lambda: not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0])
            behind = conn.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'fo'").fetchone()
            assert behind is not None and parse_lsn(str(behind[0])) < applied  # the synced copy survived the promotion
            for n in range(10, 14):
                work(conn, n)
            summary = drain(config, spark)  # through the host list: the new primary
            assert summary.batches
            for name, columns in TABLES.items():
                assert delta_rows(spark, f"{warehouse}/{name.replace('.', '/')}", columns,
                                  source_types(conn, name)) == postgres_rows(conn, name, columns), name
            journal = delta_rows(spark, f"{warehouse}/public/journal", ["n"], source_types(conn, "public.journal"))
            assert journal == sorted([(str(n),) for n in range(1, 14)], key=repr)  # nothing lost, nothing twice

            # Without a failover slot: a clear stop, never a new slot that skips changes; then the recovery.
            with pytest.raises(PreflightError, match=r"replication slot 'plain' does not exist on .* a new slot would "
                                                     r"start now and miss every change since.*resync --config <file> --all"):
                drain(plain, spark)
            resync(plain, spark, published_oids(plain, None))
            drain(plain, spark)
            for name, columns in TABLES.items():
                assert delta_rows(spark, f"{plain_warehouse}/{name.replace('.', '/')}", columns,
                                  source_types(conn, name)) == postgres_rows(conn, name, columns), name
    finally:
        standby.stop()
        primary.stop()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_stalled_stream_is_reconnected_within_three_status_intervals(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The proxy stops forwarding without closing anything: the stream goes silent although every
    status update asks for a reply. Within 3 x source.status_interval_seconds it counts as stalled,
    the pipeline reconnects (the proxy forwards new connections), ends its old walsender, which
    still holds the slot on the server, and applies what was committed meanwhile."""
    server, dbname = db18
    proxy = StallingProxy(server.port)
    try:
        with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
            conn.execute("CREATE TABLE stalled (id int PRIMARY KEY, v text)")
            conn.execute("CREATE PUBLICATION stall_pub FOR TABLE stalled")
            warehouse = str(tmp_path / "wh")
            interval = 1.0
            config = parse_config({"pipeline": "stall", "target": {"warehouse": warehouse},
                                   "source": {"dsn": f"host=127.0.0.1 port={proxy.port} user=postgres dbname={dbname}",
                                              "slot": "stall", "publication": "stall_pub",
                                              "status_interval_seconds": interval}})
            with BackgroundReplicator(config, spark) as pipeline:
                pipeline.wait_for_snapshots()
                conn.execute("INSERT INTO stalled SELECT g, 'before' FROM generate_series(1, 5) g")
                pipeline.wait_caught_up(timeout=300)
                proxy.stall()
                stalled_at = time.monotonic()
                conn.execute("INSERT INTO stalled SELECT g, 'during' FROM generate_series(6, 10) g")
                conn.execute("UPDATE stalled SET v = 'updated' WHERE id <= 2")
                pipeline.wait_caught_up(timeout=300)
                recovered = time.monotonic() - stalled_at
                assert pipeline.replicator.summary.reconnects == 1
            # The bound, the first reconnect attempt, and one small batch applied (up to 40 s on a busy
            # 2-core machine): never wal_sender_timeout (60 s), after which the server would have ended
            # its walsender itself.
            assert recovered < 3 * interval + BACKOFF_START_S + 40, recovered
            assert "the connection is stalled" in caplog.text
            assert "ended this pipeline's previous walsender" in caplog.text
            columns = ["id", "v"]
            assert delta_rows(spark, f"{warehouse}/public/stalled", columns, source_types(conn, "public.stalled")) \
                == postgres_rows(conn, "public.stalled", columns)
    finally:
        proxy.close()


@pytest.mark.spark
@pytest.mark.timeout(900)
@pytest.mark.pg
@pytest.mark.crash
def test_three_failovers_in_a_row_under_load_lose_nothing_and_apply_nothing_twice(spark, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`run --follow` through a kill -9 of the primary, a crash and a planned switchover, a load
    running through each; after each the old primary is rebuilt as the new standby from a base
    backup and must hold a synced copy of the slot before the next. After each failover, with the
    load stopped and the pipeline caught up: every table equals the new primary (Spark and
    delta-rs), the insert-only journal holding each row once."""
    warehouse = str(tmp_path / "wh")

    def equal(conn: psycopg.Connection) -> None:
        assert_delta_equals_postgres(spark, conn, warehouse)

    with FailoverDrill(warehouse, spark, hurry_standby_sync=True) as drill:
        times = drill_failovers(drill, FAILURES, rate=4.0, check=equal)
        assert [t.how for t in times] == list(FAILURES)
        summary = drill.pipeline.replicator.summary  # type: ignore[union-attr]
        assert summary.reconnects >= len(FAILURES)
        with psycopg.connect(drill.primary.dsn, autocommit=True) as conn:
            ledger = conn.execute("SELECT count(*) FROM ledger").fetchone()[0]
            markers = conn.execute("SELECT count(*) FROM journal WHERE session = -1").fetchone()[0]
        assert ledger > 20 and markers == len(FAILURES)
    print_failover_report(times)  # what `bench failover` prints, from this run's figures
    report = capsys.readouterr().out
    assert all(f"  {how:12s}" in report for how in FAILURES) and "median pipeline part" in report
    assert all(t.promotion_s > 0 and t.reconnect_s >= 0 and t.apply_s > 0 for t in times)


@pytest.mark.pg
def test_a_standby_slot_that_does_not_exist_is_named_at_start(caplog) -> None:  # type: ignore[no-untyped-def]
    """Right after a promotion, synchronized_standby_slots still names the old standby's slot: the
    server then sends a failover slot's reader nothing. The health check says so."""
    with PgServer(bindir=available_bindirs()["pg18"]) as server, \
            psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION pub")
        config = parse_config({"pipeline": "p", "source": {"dsn": server.dsn, "slot": "fo", "publication": "pub"},
                               "target": {"warehouse": "/nonexistent"}})
        create_slot(conn, "fo", failover=True)
        conn.execute("SELECT pg_create_physical_replication_slot('present')")
        conn.execute("SELECT pg_create_physical_replication_slot('gone')")  # the server checks the names when set
        conn.execute("ALTER SYSTEM SET synchronized_standby_slots = 'present, gone'")
        conn.execute("SELECT pg_reload_conf()")
        wait_for("the setting", lambda: conn.execute("SHOW synchronized_standby_slots").fetchone()[0] != "")
        conn.execute("SELECT pg_drop_replication_slot('gone')")
        assert missing_standby_slots(conn) == ["gone"]
        HealthMonitor(config.source).check(conn, starting=True)
        assert "synchronized_standby_slots names 'gone', which does not exist" in caplog.text
        assert "'present'" not in caplog.text
