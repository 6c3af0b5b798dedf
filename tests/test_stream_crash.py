"""Crash safety of the Structured Streaming apply (`cdc-apply stream`: format("pgoutput") ->
foreachBatch): kill -9 20 times under a concurrent load, restart from the checkpoint each time; at
the end Delta equals PostgreSQL, and the insert-only ``journal`` table shows that nothing was
applied twice.

The first kill is certain to land between a micro-batch's table commits (the ``between_tables``
failpoint): the rerun of that batch must find that "N already held it". Random kills cannot promise
that (CI once ran 20 without one falling there). Of the 19 random kills, half land in a new job's
first micro-batch, whose MERGEs run in a cold JVM and take 10-25 s on a 2-core machine; the other
half land in the batches after it.

After every kill: each transaction whose commit the slot's confirmed position covers is in Delta.
"""

from __future__ import annotations

import random
import re
import signal
import time

import psycopg
import pytest

from cdc_apply.bench.load import Load, create_schema
from tests.test_crash import (RANDOM_KILLS, Job, _assert_confirmed_is_durable, crash_config, kill_at_random_points,
                              ledger_seqs)
from tests.test_live import assert_delta_equals_postgres

QUERY_STARTED = "cdc_apply.stream_job: streaming query"
FIRST_BATCH = "cdc_apply.spark.foreach: batch"


def wait_until_delta_equals_postgres(spark, conn, load: Load, warehouse: str,  # type: ignore[no-untyped-def]
                                     timeout: float) -> None:
    """Polled by delta-rs on ``ledger`` (cheap) until it holds every committed transaction, then by
    the full oracle: a Spark read of every table per poll would compete with the job it waits for."""
    deadline = time.monotonic() + timeout
    while not ledger_seqs(warehouse) >= set(load.ledger_lsns) and time.monotonic() < deadline:
        time.sleep(2)
    while True:
        try:
            assert_delta_equals_postgres(spark, conn, warehouse)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(3)


@pytest.mark.timeout(2400)
def test_kill_9_the_streaming_job_at_random_points(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    config, warehouse, log = crash_config(tmp_path, conninfo,
                                          stream={"interval_seconds": 0.5, "max_changes_per_trigger": 20000})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute("SELECT pg_create_logical_replication_slot('crash', 'pgoutput')")
        load = Load(conninfo, sessions=2, rate_per_session=2, big_every=120).start()
        try:
            code = Job(config, log, verb=("stream",), failpoint="between_tables").wait(timeout=300)
            assert code == -signal.SIGKILL, f"failpoint between_tables: exit {code}\n{log.read_text()[-3000:]}"
            _assert_confirmed_is_durable(conn, load, warehouse)
            kill_at_random_points(
                conn, load, warehouse,
                lambda kill: Job(config, log, verb=("stream",), ready=FIRST_BATCH if kill % 2 else QUERY_STARTED),
                random.Random(11), window=lambda kill: 4.0 if kill % 2 else 25.0, kills=RANDOM_KILLS - 1)
        finally:
            load.finish()
        job = Job(config, log, verb=("stream",), ready=FIRST_BATCH)
        try:
            assert job.streaming.wait(timeout=180), log.read_text()[-3000:]
            wait_until_delta_equals_postgres(spark, conn, load, warehouse, timeout=600)
        finally:
            job.process.send_signal(signal.SIGTERM)
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert load.committed > 200
        _assert_confirmed_is_durable(conn, load, warehouse)
        written = log.read_text()
        assert "batch " in written
        # The batch cut short between its table commits was run again, and skipped the tables it had
        # written.
        assert re.search(r"\([1-9]\d* already held it\)", written), written[-3000:]
