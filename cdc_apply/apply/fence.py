"""The Spark Connect fence: before a process first reads a writer identity's version in a target, an
empty commit that moves that identity one past the version the target holds (docs/spark.md, "What
differs on Connect").

Why: a Connect server finishes a killed client's commit on its own, seconds later. That commit's
transaction read the identity when it began, so once the fence lands Delta fails it as a concurrent
transaction; one that landed before the fence is seen by the read that follows. One past a commit
LSN is no transaction's commit LSN (a commit record is longer than a byte), so the fence skips
nothing.

Each (location, identity) is fenced once per process, at its first touch: fencing every target
the registry lists as the applier is built, on a thread and a session of their own, was tried and
measured worse (`bench restart --connect`, 2026-11-29: the first new change applied after 7.31 s,
against 4.33 s at first touch): the first batch then waits for the fences of tables it does not
touch, which also compete with it for the server.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Protocol

from cdc_apply.apply.delta_log import LogState
from cdc_apply.apply.session_kind import is_connect

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


class Target(Protocol):
    """What the fence needs of a target (``apply/targets.Target``, which calls it)."""

    spark: SparkSession
    location: str

    def log(self) -> LogState: ...

    def record_version(self, app_id: str, version: int, user_metadata: str) -> None: ...


FENCE_ATTEMPTS = 5
_fenced: set[tuple[str, str]] = set()  # (location, identity) fenced by this process
_lock = threading.Lock()


def fence(target: Target, app_id: str) -> None:
    """``target`` fenced for ``app_id`` once this process, before its first read of ``app_id``'s
    version. Nothing on a classic session, whose commits end with its process."""
    if not is_connect(target.spark):
        return
    key = (target.location, app_id)
    with _lock:
        if key in _fenced:
            return
    for attempt in range(FENCE_ATTEMPTS):
        held = target.log().writers.get(app_id)
        if held is None:
            # No version to move past: a made-up one would tell the applier the table equals the
            # source as of it (``BatchApplier._plan``'s ``appendable``), true of no adopted table.
            break
        try:
            target.record_version(app_id, held.version + 1, json.dumps({"cdc_apply": "fence", "app_id": app_id}))
            log.debug("%s: fenced %s at version %d", target.location, app_id, held.version + 1)
            break
        except Exception as exc:  # the late commit landed first: read the log again
            if "DELTA_CONCURRENT_" not in str(exc) or attempt == FENCE_ATTEMPTS - 1:
                raise
    with _lock:
        _fenced.add(key)
