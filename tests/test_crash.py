"""What the kill -9 drills share (``drill_and_compare``, ``CRASH_TEST_KILLS``), and where each of
`run --follow`'s failpoints is killed in CI.

The drills: `stream` (tests/test_stream_crash.py), `run --follow` with ``confirm_after: changelog``
(tests/test_changelog_crash.py), `run --follow` with the warehouse on S3 (tests/test_object_store.py:
the failpoints after a commit) and `run --follow` as a Spark Connect client (tests/test_spark_connect.py:
every failpoint of the stream, then random points). After every kill: each transaction whose commit the slot's
confirmed position covers is durable (``confirmed_flush_lsn`` never passes what Delta holds); at the
end Delta equals PostgreSQL (nothing lost, and the insert-only ``journal`` table shows nothing
applied twice).

Until 2026-12-03 a follow drill on the local disk killed at the two failpoints before a commit, and
the drill on S3 at the two after one and at random: four JVMs more. The two before a commit are the
driver's loop before any write, the same code whatever the session or the store, and the Connect
drill kills at them; `run --follow` is killed at random on a classic session by the change log's
drill. `cdc-apply bench crash --mode MODE
--kills 20` keeps the full count of random kills (the README gives its figures). The drill is the
bench's (``cdc_apply/bench/crash.py``), so both run the same kills and the same checks.
"""

from __future__ import annotations

import os

import psycopg

from cdc_apply.bench.crash import MODE_FAILPOINTS, CrashDrill, load_table_differences
from tests.test_live import assert_delta_equals_postgres

# Random kills per drill in CI (docs/testing.md), after the failpoint kills: each costs a new JVM and
# its first batch.
CRASH_TEST_KILLS = int(os.environ.get("CDC_APPLY_CRASH_TEST_KILLS", "1"))


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


def test_the_follow_drills_kill_at_every_failpoint_of_the_stream() -> None:
    from tests.test_object_store import S3_FAILPOINTS
    from tests.test_spark_connect import CONNECT_FAILPOINTS

    assert sorted(CONNECT_FAILPOINTS) == sorted(MODE_FAILPOINTS["follow"])
    assert set(S3_FAILPOINTS) == {"between_tables", "before_confirm"}  # after a commit to the bucket
