"""Crash safety of `cdc-apply run --follow`: kill -9 at each stage boundary (the failpoints) under a
concurrent load, restart each time; at the end Delta equals PostgreSQL
(nothing lost, and the insert-only ``journal`` table shows nothing applied twice).

After every kill: each transaction whose commit the slot's confirmed position covers is in Delta
(``confirmed_flush_lsn`` never passes what Delta holds).

CI makes ``CRASH_TEST_KILLS`` random kills in the other drills (this one has none, and kills at the
two failpoints before a commit: the drill on S3 kills at the two after one, and the drills on S3 and
on Spark Connect kill `run --follow` at random); `cdc-apply bench crash --mode MODE --kills 20`
keeps the full count (the README gives its figures). The drill is the bench's
(``cdc_apply/bench/crash.py``), so both run the same kills and the same checks.
"""

from __future__ import annotations

import os

import psycopg
import pytest

from cdc_apply.bench.crash import MODE_FAILPOINTS, CrashDrill, load_table_differences
from tests.test_live import assert_delta_equals_postgres

# Random kills per drill in CI (docs/testing.md), after the failpoint kills: each costs a new JVM and
# its first batch. The stream drill makes at least 2, one of each of its two kinds.
CRASH_TEST_KILLS = int(os.environ.get("CDC_APPLY_CRASH_TEST_KILLS", "1"))

# The local follow drill's failpoint kills: the ones the drill on S3 leaves out (it kills at the
# other two, S3_FAILPOINTS in tests/test_object_store.py), so each failpoint is killed once on a classic session.
LOCAL_FAILPOINTS = ("after_receive", "after_decode")

pytestmark = pytest.mark.crash


def drill_and_compare(mode: str, seed: int, db18, spark, tmp_path, min_committed: int,  # type: ignore[no-untyped-def]
                      kills: int = CRASH_TEST_KILLS, failpoints: tuple[str, ...] | None = None) -> CrashDrill:
    """The drill of ``mode`` on a fresh database; nothing lost after any kill, and every target equal
    to PostgreSQL at the end (read by Spark and by delta-rs)."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    drill = CrashDrill(mode, conninfo, tmp_path, kills=kills, seed=seed, failpoints=failpoints)
    drill.run()
    assert not drill.problems, drill.problems
    assert drill.load is not None and drill.load.committed > min_committed
    assert drill.random_kills == kills
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert_delta_equals_postgres(spark, conn, drill.warehouse)
        # The soak's own comparison (`cdc-apply bench crash`) agrees.
        assert load_table_differences(spark, conn, drill.warehouse) == {}
    return drill


@pytest.mark.timeout(1800)
def test_kill_9_at_each_stage_boundary(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # No random kill here, and the two failpoints before a commit only: `run --follow` is killed at
    # the two after a commit (between_tables, before_confirm) and at random by the drill on S3
    # (tests/test_object_store.py), at all four and at random by the drill on Spark Connect
    # (tests/test_spark_connect.py), and the soak keeps the full count. Each kill costs a new JVM.
    drill = drill_and_compare("follow", 7, db18, spark, tmp_path, min_committed=30, kills=0,
                              failpoints=LOCAL_FAILPOINTS)
    assert drill.failpoint_kills == len(LOCAL_FAILPOINTS)
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


def test_the_classic_follow_drills_kill_at_every_failpoint_of_the_stream() -> None:
    from tests.test_object_store import S3_FAILPOINTS

    assert sorted(LOCAL_FAILPOINTS + S3_FAILPOINTS) == sorted(MODE_FAILPOINTS["follow"])
