"""Operating the pipeline as a service, on real servers: metrics scraped over HTTP during a live run
under load and checked against its summary, /healthz, every slot problem with its recovery
(an invalidated slot, a slot in use, the retained-WAL limit, a table leaving the publication, the
publication dropped), `status`, and `resync` under load and after a SIGKILL half-way."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cdc_apply.bench.load import TABLES, Load, create_schema
from cdc_apply.config import Config, parse_config
from cdc_apply.live import BackgroundReplicator
from cdc_apply.metrics import MetricsServer, PipelineMetrics
from cdc_apply.pgserver import PgServer, available_bindirs, free_port
from cdc_apply.pipeline import drain
from cdc_apply.runtime import StopFlag
from cdc_apply.resync import published_oids, resync
from cdc_apply.sources.health import SlotUnusable
from cdc_apply.sources.slot import wait_until_caught_up
from cdc_apply.sources.walsender import WalSenderStream
from cdc_apply.sources.preflight import protocol_options
from cdc_apply.status import pipeline_status, watch
from cdc_apply.stream_job import run_stream
from tests.test_live import assert_delta_equals_postgres, live_config, wait_for_slot

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _scrape(port: int) -> Samples:
    status, text = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, found), v in samples.items() if n == name and all((k, x) in found for k, x in labels.items()))


@pytest.fixture()
def load_db(db18, tmp_path) -> Iterator[tuple[str, str, psycopg.Connection]]:  # type: ignore[no-untyped-def]
    """(conninfo, warehouse, connection) of a fresh PostgreSQL 18 database holding the load's tables."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        yield conninfo, str(tmp_path / "wh"), conn


def test_metrics_are_served_during_a_live_run_and_match_its_summary(load_db, spark) -> None:  # type: ignore[no-untyped-def]
    conninfo, warehouse, conn = load_db
    config = parse_config({**live_config(conninfo, warehouse).model_dump(exclude_defaults=True),
                           "metrics": {"port": 0}})
    with BackgroundReplicator(config, spark) as follower:
        follower.wait_for_snapshots()
        wait_for_slot(conninfo, "live")
        load = Load(conninfo, sessions=2, rate_per_session=30, big_every=40).start()
        deadline = time.monotonic() + 180
        while follower.replicator.metrics_server is None or not follower.replicator.summary.batches:
            assert time.monotonic() < deadline, "no batch applied"
            time.sleep(0.2)
        port = follower.replicator.metrics_server.port
        during = _scrape(port)
        assert _get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
        time.sleep(3)
        load.finish()
        wait_until_caught_up(conninfo, "live", timeout=300)
        after = _scrape(port)
        summary = follower.replicator.summary
        labels = {"pipeline": "live"}
        assert _value(during, "cdc_apply_changes_received_total", **labels) > 0
        applied = sum(batch.changes for batch in summary.batches)
        assert applied > 500
        assert _value(after, "cdc_apply_changes_applied_total", **labels) == applied
        assert _value(after, "cdc_apply_changes_received_total", **labels) >= applied
        assert _value(after, "cdc_apply_commit_to_delta_lag_seconds_count", **labels) == len(summary.lag_seconds)
        assert _value(after, "cdc_apply_commit_to_delta_lag_seconds_sum", **labels) == pytest.approx(
            sum(summary.lag_seconds), rel=1e-6)
        assert _value(after, "cdc_apply_batch_apply_seconds_count", **labels) == len(summary.batches)
        per_table: Counter[tuple[str, str]] = Counter()
        last_lsn: dict[str, int] = {}
        for batch in summary.batches:
            for table in batch.tables:
                if not table.skipped:
                    for op, count in table.ops.items():
                        per_table[(table.table, op)] += count
                    last_lsn[table.table] = max(last_lsn.get(table.table, 0), table.last_lsn or 0)
        for (table, op), count in per_table.items():
            assert _value(after, "cdc_apply_table_changes_total", table=table, op=op) == count, (table, op)
        for table, lsn in last_lsn.items():
            assert _value(after, "cdc_apply_table_last_commit_lsn", table=table) == lsn
            assert _value(after, "cdc_apply_table_last_commit_timestamp_seconds", table=table) > time.time() - 600
        assert _value(after, "cdc_apply_confirmed_lsn", **labels) == summary.confirmed_lsn
        assert _value(after, "cdc_apply_slot_retained_wal_bytes", **labels) > 0
        assert _value(after, "cdc_apply_reconnects_total", **labels) == 0
        assert _value(after, "cdc_apply_last_status_timestamp_seconds", **labels) > time.time() - 30
    assert_delta_equals_postgres(spark, conn, warehouse)
    status = pipeline_status(config)
    assert status["slot"]["exists"] and status["slot"]["active_pid"] is None
    applied_lsns = {row["table"]: row["applied_lsn"] for row in status["tables"]}
    assert set(applied_lsns) == set(TABLES) and all(applied_lsns.values())


def test_healthz_says_wedged_after_two_status_intervals_of_silence() -> None:
    metrics = PipelineMetrics("p", beat_interval_s=10)
    assert metrics.health() == (True, "starting")
    metrics.beat()
    assert metrics.health() == (True, "ok")
    healthy, text = metrics.health(now=time.monotonic() + 25)
    assert not healthy and text.startswith("wedged: no status update for 25 s")
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        assert _get(f"http://127.0.0.1:{server.port}/healthz") == (200, "ok\n")
        assert metrics.last_beat is not None
        metrics.last_beat -= 21
        status, text = _get(f"http://127.0.0.1:{server.port}/healthz")
        assert status == 503 and "wedged" in text
    finally:
        server.close()


def _ops_config(dsn: str, warehouse: str, snapshot: dict[str, object] | None = None, **source: object) -> Config:
    return parse_config({"pipeline": "ops", "source": {"dsn": dsn, "slot": "ops", "publication": "load", **source},
                         "target": {"warehouse": warehouse}, "snapshot": snapshot or {}})


def _write_wal(conn: psycopg.Connection, rows: int) -> None:
    conn.execute("INSERT INTO journal SELECT -1, g, repeat('w', 50) FROM generate_series(1::int, %s::int) g", (rows,))


@pytest.mark.pg
def test_slot_problems_stop_or_warn_naming_the_recovery(spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    server = PgServer(bindir=available_bindirs()["pg18"], settings={"max_slot_wal_keep_size": "1MB"}).start()
    try:
        warehouse = str(tmp_path / "wh")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            create_schema(conn, "load")
            config = _ops_config(server.dsn, warehouse)
            drain(config, spark)

            # Retained WAL over the limit: a warning, or a stop, each naming the numbers.
            _write_wal(conn, 100)
            drain(_ops_config(server.dsn, warehouse, max_retained_wal=1), spark)
            assert "more than source.max_retained_wal (1 bytes); " in caplog.text
            assert "bytes remain before max_slot_wal_keep_size invalidates it (source.on_retained_wal: warn)" \
                in caplog.text
            _write_wal(conn, 100)
            with pytest.raises(SlotUnusable, match=r"more than source.max_retained_wal .* Stopped "
                                                   r"\(source.on_retained_wal: stop\)"):
                drain(_ops_config(server.dsn, warehouse, max_retained_wal="1KB", on_retained_wal="stop"), spark)

            # Another process reads the slot.
            other = WalSenderStream(server.dsn, "ops", protocol_options(config.source, 180000))
            other.start()
            try:
                pid = other.conn.pgconn.backend_pid
                with pytest.raises(SlotUnusable, match=f"in use by another process \\(PID {pid}\\)"):
                    drain(config, spark)
            finally:
                other.close()

            # The server invalidates the slot while the pipeline is stopped.
            for _ in range(3):
                _write_wal(conn, 2000)
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
            with pytest.raises(SlotUnusable, match=r"slot 'ops' was invalidated by the server \(wal_removed\).*"
                                                   r"pg_drop_replication_slot\('ops'\).*resync --config <file> --all"):
                drain(config, spark)
            # The documented recovery: drop it, resync every table (creates the new slot first), run on.
            conn.execute("SELECT pg_drop_replication_slot('ops')")
            copied = resync(config, spark, published_oids(config, None))
            assert sorted(t.table for t in copied) == sorted(TABLES)
            _write_wal(conn, 10)
            conn.execute("UPDATE accounts SET balance = balance + 1")
            drain(config, spark)
            assert_delta_equals_postgres(spark, conn, warehouse)

            # While following: a table leaves the publication (a warning), then the publication goes (a stop).
            live = _ops_config(server.dsn, warehouse, health_interval_seconds=0.5)
            follower = BackgroundReplicator(live, spark).start()
            wait_for_slot(server.dsn, "ops")
            time.sleep(2)
            conn.execute("ALTER PUBLICATION load DROP TABLE tags")
            deadline = time.monotonic() + 90
            while "table public.tags left publication load" not in caplog.text:
                assert time.monotonic() < deadline, "no warning for the table that left the publication"
                time.sleep(0.2)
            assert "ALTER PUBLICATION load ADD TABLE public.tags, then `cdc-apply resync --table public.tags`" \
                in caplog.text
            conn.execute("DROP PUBLICATION load")
            follower.thread.join(60)
            assert not follower.thread.is_alive()
            with pytest.raises(SlotUnusable, match="publication 'load' no longer exists"):
                follower.finish()
    finally:
        server.stop()


def _write_config(path: Path, config: Config) -> str:
    path.write_text(yaml.safe_dump(json.loads(config.model_dump_json(exclude_defaults=True))))
    return str(path)


@pytest.mark.crash
def test_resync_under_load_and_after_a_kill_ends_equal(load_db, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    conninfo, warehouse, conn = load_db
    config = _ops_config(conninfo, warehouse, {"range_pages": 1, "ranges_per_commit": 1})  # a commit per page
    drain(config, spark)
    load = Load(conninfo, sessions=2, rate_per_session=20, big_every=60).start()
    time.sleep(4)  # ledger then holds 2 pages or more: Spark's tasks copy it, a range each
    # A column type that cannot widen (integer -> text): the resync rebuilds the target with it.
    conn.execute("ALTER TABLE ledger ALTER COLUMN amount TYPE text USING amount::text")
    copied = resync(config, spark, published_oids(config, ["public.ledger"]))
    time.sleep(2)
    load.finish()
    assert [t.table for t in copied] == ["public.ledger"] and copied[0].rows > 0
    assert spark.read.format("delta").load(f"{warehouse}/public/ledger").schema["amount"].dataType.simpleString() \
        == "string"
    drain(config, spark)
    assert_delta_equals_postgres(spark, conn, warehouse)

    # Killed after 2 chunks: the target counts as not in sync until a later resync finishes it.
    # Ranges of 2 pages, not 1: a resumed copy MERGEs each range by key, one commit each, in a new JVM.
    # The load alone may leave fewer pages than that on a fast run: rows of ids no load session uses.
    conn.execute("INSERT INTO accounts SELECT 900000000 + g, 'filler', g, NULL, now() FROM generate_series(1, 1500) g")
    pages = conn.execute("SELECT pg_relation_size('accounts') / 8192").fetchone()[0]
    assert pages > 3 * 2, f"accounts has {pages} pages: too few ranges to resume after 2"
    load = Load(conninfo, sessions=1, rate_per_session=10, big_every=0, seed=2).start()
    time.sleep(1)
    config_file = _write_config(tmp_path / "ops.yaml",
                                _ops_config(conninfo, warehouse, {"range_pages": 2, "ranges_per_commit": 1}))
    env = {**os.environ, "CDC_APPLY_FAILPOINT": "snapshot_chunk:2"}
    killed = subprocess.run([sys.executable, "-m", "cdc_apply.cli", "resync", "--config", config_file,
                             "--table", "public.accounts"], env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    pending = {row["table"]: row["resync_pending"] for row in pipeline_status(config)["tables"]}
    assert pending == {name: name == "public.accounts" for name in TABLES}
    # The resumed copy commits the rest in one MERGE: where it resumes does not depend on its commits.
    # In this process (a new JVM each would cost about 20 s): the killed one was the new process.
    caplog.set_level(logging.INFO, logger="cdc_apply")
    rest_in_one_commit = _ops_config(conninfo, warehouse, {"range_pages": 2})
    resync(rest_in_one_commit, spark, published_oids(rest_in_one_commit, ["public.accounts"]))
    load.finish()
    assert "resuming the copy of public.accounts after range [0, 4]" in caplog.text
    assert not any(row["resync_pending"] for row in pipeline_status(config)["tables"])
    drain(config, spark)
    assert_delta_equals_postgres(spark, conn, warehouse)

    bad = subprocess.run([sys.executable, "-m", "cdc_apply.cli", "resync", "--config", config_file,
                          "--table", "public.nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "public.nope not in publication 'load'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_status_watch_draws_the_slot_and_tables(load_db, spark, capsys) -> None:  # type: ignore[no-untyped-def]
    conninfo, warehouse, _ = load_db
    config = _ops_config(conninfo, warehouse)
    drain(config, spark)
    watch(config, refreshes=2, interval=0.1)
    drawn = capsys.readouterr().out
    assert "retained WAL" in drawn and "ops (reserved)" in drawn
    applied = {row["table"]: row["applied_lsn"] for row in pipeline_status(config)["tables"]}
    for table, lsn in applied.items():
        assert table in drawn and lsn in drawn


def test_stream_serves_metrics_that_count_what_postgres_committed(load_db, spark) -> None:  # type: ignore[no-untyped-def]
    conninfo, warehouse, conn = load_db
    port = free_port()
    config = parse_config({"pipeline": "st", "source": {"dsn": conninfo, "slot": "st", "publication": "load"},
                           "target": {"warehouse": warehouse}, "stream": {"interval_seconds": 0.5},
                           "metrics": {"port": port}})
    stop = StopFlag()
    outcome: list[object] = []
    runner = threading.Thread(target=lambda: outcome.append(run_stream(config, spark, stop)), daemon=True)
    runner.start()
    wait_for_slot(conninfo, "st")
    load = Load(conninfo, sessions=2, rate_per_session=20, big_every=0).start()
    time.sleep(6)
    load.finish()
    wait_until_caught_up(conninfo, "st", timeout=300)
    assert _get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
    samples = _scrape(port)
    stop.event.set()
    runner.join(120)
    assert outcome, "run_stream did not return"
    ledger_rows = conn.execute("SELECT count(*) FROM ledger").fetchone()[0]  # one insert per transaction
    assert ledger_rows == load.committed > 20
    assert _value(samples, "cdc_apply_table_changes_total", table="public.ledger", op="I") == ledger_rows
    assert _value(samples, "cdc_apply_changes_received_total", pipeline="st") >= 2 * ledger_rows  # journal + ledger
    assert _value(samples, "cdc_apply_commit_to_delta_lag_seconds_count", pipeline="st") == load.committed
    assert_delta_equals_postgres(spark, conn, warehouse)
