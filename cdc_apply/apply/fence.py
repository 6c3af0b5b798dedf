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

After a clean stop there is nothing to fence: the stopped process had every command answered
before it ended. ``clean_stops`` writes what it fenced, with each identity's version at the stop,
to ``<warehouse>/_cdc_apply/clean_stop/<pipeline>.json``; the next process takes that marker away
before its first write, and skips the fence of a (location, identity) whose version is still the
one the marker names. A process that is killed, or ends with an error, leaves no marker, so the one
after it fences. This relies on one writer process per pipeline at a time, as the slot does
(docs/operations.md, "More than one writer per table").
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from cdc_apply.apply.delta_log import LogState
from cdc_apply.apply.session_kind import is_connect
from cdc_apply.lake.location import Location, StorageError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_apply.lake.state import PipelineState

log = logging.getLogger(__name__)


class Target(Protocol):
    """What the fence needs of a target (``apply/targets.Target``, which calls it)."""

    spark: SparkSession
    location: str

    def log(self) -> LogState: ...

    def record_version(self, app_id: str, version: int, user_metadata: str) -> None: ...


FENCE_ATTEMPTS = 5
_fenced: dict[tuple[str, str], Target] = {}  # (location, identity) fenced by this process
_stopped_cleanly_at: dict[tuple[str, str], int] = {}  # the last clean stop's versions, by (location, identity)
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
        if _stopped_cleanly_at.get(key) == held.version:
            log.debug("%s: %s stopped cleanly at version %d; not fenced", target.location, app_id, held.version)
            break
        try:
            target.record_version(app_id, held.version + 1, json.dumps({"cdc_apply": "fence", "app_id": app_id}))
            log.debug("%s: fenced %s at version %d", target.location, app_id, held.version + 1)
            break
        except Exception as exc:  # the late commit landed first: read the log again
            if "DELTA_CONCURRENT_" not in str(exc) or attempt == FENCE_ATTEMPTS - 1:
                raise
    with _lock:
        _fenced[key] = target


def _marker(state: PipelineState) -> Location:
    return state.location("clean_stop", f"{state.component}.json")


@contextmanager
def clean_stops(spark: SparkSession, state: PipelineState) -> Iterator[None]:
    """Around a writer process's whole run: the last clean stop's marker taken (and removed) before
    anything is written, and this run's written when it ends without an error. Nothing on a
    classic session."""
    if not is_connect(spark):
        yield
        return
    location = _marker(state)
    try:  # the marker is a shortcut only: without it every target is fenced
        found = state.read_json(location)
        if found is not None:
            state.storage.delete(location)  # from here a kill leaves no marker
            with _lock:
                _stopped_cleanly_at.update({(entry["location"], entry["app_id"]): int(entry["version"])
                                            for entry in found.get("fenced", [])})
    except StorageError as exc:
        log.warning("%s; every target is fenced", exc)
    yield
    with _lock:
        fenced = list(_fenced.items())
        # Not touched by this run, so still as the stop before it left them.
        entries = [{"location": key[0], "app_id": key[1], "version": version}
                   for key, version in _stopped_cleanly_at.items() if key not in _fenced]
    for (target_location, app_id), target in fenced:
        held = target.log().writers.get(app_id)
        if held is not None:
            entries.append({"location": target_location, "app_id": app_id, "version": held.version})
    try:
        state.write_json(location, {"fenced": entries})
    except StorageError as exc:  # the run itself ended well: the next one fences
        log.warning("the clean stop's marker was not written (%s); the next run fences every target", exc)
