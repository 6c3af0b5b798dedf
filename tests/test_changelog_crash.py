"""Crash safety of ``changelog.confirm_after: changelog`` (`cdc-apply run --follow`): kill -9 at
random points under a concurrent load, restart each time.

After every kill: each transaction whose commit the slot's confirmed position covers is in the
change log (the slot is confirmed at the log, not at the targets), and the log holds no
transaction twice. At the end every target equals PostgreSQL, and the insert-only ``journal``
table shows that nothing was applied twice.
"""

from __future__ import annotations

import pytest

from tests.test_crash import drill_and_compare

pytestmark = pytest.mark.crash


@pytest.mark.timeout(1800)
def test_kill_9_with_the_slot_confirmed_at_the_change_log(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    drill = drill_and_compare("changelog", 17, db18, spark, tmp_path, min_committed=30)
    assert drill.failpoint_kills == 0
