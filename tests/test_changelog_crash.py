"""Crash safety of ``changelog.confirm_after: changelog`` (`cdc-apply run --follow`): kill -9 at
random points under a concurrent load, restart each time.

After every kill: each transaction whose commit the slot's confirmed position covers is in the
change log (the slot is confirmed at the log, not at the targets), and the log holds no
transaction twice. At the end every target equals PostgreSQL, and the insert-only ``journal``
table shows that nothing was applied twice.
"""

from __future__ import annotations

import psycopg
import pytest

from cdc_apply.bench.crash import report
from tests.test_crash import CRASH_TEST_KILLS, drill_and_compare

pytestmark = pytest.mark.crash


@pytest.mark.timeout(1800)
def test_kill_9_with_the_slot_confirmed_at_the_change_log(db18, spark, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    drill = drill_and_compare("changelog", 17, db18, spark, tmp_path, min_committed=10)
    assert drill.failpoint_kills == 0
    # The soak's report (`cdc-apply bench crash`) of the same drill.
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        result = report(drill, spark, conn, seconds=1.0)
    printed = capsys.readouterr().out
    assert result == {"failpoint_kills": 0, "random_kills": CRASH_TEST_KILLS, "committed": drill.load.committed,
                      "lost": 0, "applied_twice": 0, "problems_after_kills": 0, "tables_differing": 0}, printed
    assert f"kills: 0 at failpoints + {CRASH_TEST_KILLS} at random points; {drill.load.committed} transactions" \
        in printed, printed
    assert "lost: 0; applied twice (journal rows over PostgreSQL's): 0" in printed, printed
    assert "tables equal to PostgreSQL: 4 of 4" in printed, printed
