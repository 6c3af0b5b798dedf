"""Crash safety of the Structured Streaming apply (`cdc-apply stream`: format("pgoutput") ->
foreachBatch): kill -9 under a concurrent load, restart from the checkpoint each time; at the end
Delta equals PostgreSQL, and the insert-only ``journal`` table shows that nothing was applied twice.

The first kill is certain to land between a micro-batch's table commits (the ``between_tables``
failpoint): the rerun of that batch must find that "N already held it". Random kills cannot promise
that (CI once ran 20 without one falling there). Of the random kills, half land in a new job's
first micro-batch, whose MERGEs run in a cold JVM; the other half in the batches after it.

After every kill: each transaction whose commit the slot's confirmed position covers is in Delta.
"""

from __future__ import annotations

import psycopg
import pytest

from cdc_apply.bench.crash import load_table_differences
from tests.test_crash import CRASH_TEST_KILLS, drill_and_compare

pytestmark = pytest.mark.crash


@pytest.mark.timeout(1800)
def test_kill_9_the_streaming_job_at_random_points(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The failpoint's kill lands in a new job's first micro-batch; the random kill anywhere in a job's
    # first 25 s (the soak alternates the two kinds).
    drill = drill_and_compare("stream", 11, db18, spark, tmp_path, min_committed=30, kills=CRASH_TEST_KILLS)
    assert drill.failpoint_kills == 1
    written = drill.log.read_text()
    assert "batch " in written
    # The batch cut short between its table commits was run again, and skipped the tables it had written.
    assert drill.reran_a_batch_that_was_partly_written(), written[-3000:]
    # The soak's comparison sees a row applied twice and a value changed.
    journal, accounts = (f"{drill.warehouse}/public/{name}" for name in ("journal", "accounts"))
    spark.read.format("delta").load(journal).limit(1).write.format("delta").mode("append").save(journal)
    last = spark.read.format("delta").load(accounts).agg({"id": "max"}).first()[0]
    spark.sql(f"UPDATE delta.`{accounts}` SET balance = balance + 1 WHERE id = {last}")
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        differences = load_table_differences(spark, conn, drill.warehouse)
        journal_rows = conn.execute("SELECT count(*) FROM journal").fetchone()[0]
    assert differences.keys() == {"public.journal", "public.accounts"}, differences
    assert differences["public.journal"] == (journal_rows + 1, journal_rows)
