"""The Spark Connect fence: before a process first reads a writer identity's version in a target, an
empty commit that moves that identity one past the version the target holds (docs/spark.md, "What
differs on Connect").

Why: a Connect server finishes a killed client's commit on its own, seconds later. That commit's
transaction read the identity when it began, so once the fence lands Delta fails it as a concurrent
transaction; one that landed before the fence is seen by the read that follows. One past a commit
LSN is no transaction's commit LSN (a commit record is longer than a byte), so the fence skips
nothing.

Each (location, identity) is fenced once per process. ``start_fences`` fences the targets a pipeline
already knows on a thread and a session of their own, while the process connects to PostgreSQL and
receives its first batch; ``fence`` waits for that fence (or makes it) before the first read.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from cdc_apply.apply.delta_log import LogState
from cdc_apply.apply.session_kind import is_connect, new_session

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
_fences: dict[tuple[str, str], Future[None]] = {}  # (location, identity) -> its fence in this process
_lock = threading.Lock()


def fence(target: Target, app_id: str) -> None:
    """``target`` fenced for ``app_id`` before this returns: by a fence begun at the start, or now.
    Nothing on a classic session, whose commits end with its process."""
    if not is_connect(target.spark):
        return
    key = (target.location, app_id)
    with _lock:
        future = _fences.get(key)
        mine = future is None
        if future is None:
            future = _fences[key] = Future()
    if mine:
        _run(future, lambda: _fence_now(target, app_id))
    try:
        future.result()
    except Exception:
        with _lock:  # a later touch tries again
            if _fences.get(key) is future:
                del _fences[key]
        raise


def start_fences(spark: SparkSession, targets: Iterable[tuple[Callable[[SparkSession], Target], str]]) -> None:
    """Fence each target (built on a session by the callable) for its identity, on a thread and a
    session of their own: the fence's commit confs must not meet another thread's commits. Returns at
    once; ``fence`` waits for each. Nothing on a classic session."""
    if not is_connect(spark):
        return
    pending: list[tuple[Future[None], Callable[[SparkSession], Target], str]] = []
    with _lock:
        for build, app_id in targets:
            location = build(spark).location
            if (location, app_id) not in _fences:
                future: Future[None] = Future()
                _fences[(location, app_id)] = future
                pending.append((future, build, app_id))
    if pending:
        threading.Thread(target=_fence_all, args=(spark, pending), name="cdc-apply-fence", daemon=True).start()


def _fence_all(spark: SparkSession, pending: list[tuple[Future[None], Callable[[SparkSession], Target], str]]) -> None:
    try:
        session = new_session(spark)
    except Exception as exc:  # each waiting touch raises it
        for future, _, _ in pending:
            future.set_exception(exc)
        return
    for future, build, app_id in pending:
        _run(future, lambda: _fence_now(build(session), app_id))


def _run(future: Future[None], work: Callable[[], None]) -> None:
    try:
        work()
    except Exception as exc:
        future.set_exception(exc)
    else:
        future.set_result(None)


def _fence_now(target: Target, app_id: str) -> None:
    for attempt in range(FENCE_ATTEMPTS):
        held = target.log().writers.get(app_id)
        if held is None:
            # No version to move past: a made-up one would tell the applier the table equals the
            # source as of it (``BatchApplier._plan``'s ``appendable``), true of no adopted table.
            return
        try:
            target.record_version(app_id, held.version + 1, json.dumps({"cdc_apply": "fence", "app_id": app_id}))
            log.debug("%s: fenced %s at version %d", target.location, app_id, held.version + 1)
            return
        except Exception as exc:  # the late commit landed first: read the log again
            if "DELTA_CONCURRENT_" not in str(exc) or attempt == FENCE_ATTEMPTS - 1:
                raise
