"""The targets brought up from the change log on a thread of their own, beside the stream that
appends to it (``changelog.confirm_after: changelog`` with ``targets: in_process``): the
``TargetFollower`` and when it yields to a backlog (docs/change-log-table.md).
"""

from __future__ import annotations

import logging
import threading
import time

from cdc_apply.changelog.applier import ChangeLogApplier
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import pg_us_to_unix_us
from cdc_apply.transactions import SpilledChanges, Transaction

log = logging.getLogger(__name__)


class TargetsFromChangeLogFailed(CdcApplyError):
    """The follower thread stopped on an error: the stream stops too (the log keeps every batch)."""


# At most this long the targets wait for the stream to work through a backlog before they take their
# share of the machine again: the targets may lag the log, never starve.
BACKLOG_YIELD_S = 30.0
# The stream is working through a backlog when its batches are full (``batching.max_changes``), or
# when the newest transaction of a logged batch committed this long before the log held it: in the
# steady state that lag is about a second (bench e2e --changelog: p99 1.1-2.0 s).
BACKLOG_LAG_S = 5.0
# ... and it has caught up when no batch came for this long (its batches come every
# ``batching.max_seconds`` or faster while it has a backlog).
BACKLOG_QUIET_S = 3.0


def shows_a_backlog(batch: list[Transaction], max_changes: int, now: float) -> bool:
    """Whether a logged batch shows the stream working through a backlog at ``now`` (Unix seconds):
    it is full, or its newest transaction committed more than ``BACKLOG_LAG_S`` before."""
    changes = sum(len(t.changes) for t in batch)
    return changes >= max_changes or (
        bool(batch) and now - pg_us_to_unix_us(batch[-1].commit_ts) / 1e6 > BACKLOG_LAG_S)


def still_yielding(backlog_since: float | None, last_logged: float, now: float) -> bool:
    """Whether the targets still wait for the stream (monotonic seconds): a backlog was seen, less
    than ``BACKLOG_YIELD_S`` ago, and a batch came within ``BACKLOG_QUIET_S``."""
    return backlog_since is not None and now - backlog_since < BACKLOG_YIELD_S and now - last_logged < BACKLOG_QUIET_S


class TargetFollower:
    """A ``ChangeLogApplier`` on its own thread: woken after each log append, it applies what the log
    holds past the targets. ``error`` is what stopped it; the stream's loop raises it.

    The batches the stream appends are also handed over in memory (``logged``), up to
    ``max_changes`` changes waiting: while that queue holds every batch logged since the targets'
    position, they are applied from it, without reading the log back. A batch that does not fit, or
    holds a spilled transaction (its spill file is the stream's), breaks the chain: the next round
    reads the log from the position, and the chain starts again after what that read held."""

    def __init__(self, applier: ChangeLogApplier) -> None:
        self.applier = applier
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._backlog_since: float | None = None  # monotonic time the stream's backlog was seen first
        self._last_logged = time.monotonic()  # ... and when it last logged a batch
        self._queue: list[list[Transaction]] = []  # batches logged since the last read of the log
        self._queued_changes = 0
        self._chained = False  # the queue holds every batch logged after the targets' position
        self.applied_lsn: int | None = applier.position.read() if applier.position is not None else None
        self._thread = threading.Thread(target=self._run, name="cdc-apply-targets", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> TargetFollower:
        self._wake.set()  # a log written by an earlier run may be ahead of the targets
        self._thread.start()
        return self

    def logged(self, batch: list[Transaction]) -> None:
        """The log holds ``batch`` now. A batch of ``max_changes``, or one whose newest transaction
        committed more than ``BACKLOG_LAG_S`` ago, means the stream is working through a backlog: the
        follower then yields the machine to it (``BACKLOG_YIELD_S`` at most), so the slot's confirmed
        position, which is what holds WAL on the server, catches up first."""
        changes = sum(len(t.changes) for t in batch)
        backlog = shows_a_backlog(batch, self.applier.max_changes, time.time())
        with self._idle:
            self._last_logged = time.monotonic()
            self._backlog_since = (self._backlog_since or time.monotonic()) if backlog else None
            if self._queued_changes + changes > self.applier.max_changes or \
                    any(isinstance(t.changes, SpilledChanges) for t in batch):
                self._chained = False
            if self._chained:
                self._queue.append(list(batch))
                self._queued_changes += changes
            else:
                self._queue, self._queued_changes = [], 0
        self._wake.set()

    def _take_queue(self) -> list[Transaction] | None:
        """The queued batches' transactions when they continue the targets' position; else None, and
        the chain starts again (the caller reads the log, which holds whatever was logged so far)."""
        with self._idle:
            batches, chained = self._queue, self._chained
            self._queue, self._queued_changes, self._chained = [], 0, True
        return [t for batch in batches for t in batch] if chained else None

    def _yield_to_a_backlog(self) -> None:
        while not self._stopping.is_set():
            with self._idle:
                since, last = self._backlog_since, self._last_logged
            if not still_yielding(since, last, time.monotonic()):
                return
            self._stopping.wait(0.2)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._wake.wait(timeout=1.0):
                    continue
                self._wake.clear()
                self._yield_to_a_backlog()
                if self._stopping.is_set():
                    break
                queued = self._take_queue()
                if queued is None:
                    self.applier.catch_up(stopping=self._stopping)
                elif queued:
                    self.applier.apply_logged(queued)
                with self._idle:
                    self.applied_lsn = self.applier.position.read() if self.applier.position else None
                    self._idle.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised again on the stream's thread
            self.error = exc
            with self._idle:
                self._idle.notify_all()

    def raise_error(self) -> None:
        if self.error is not None:
            raise TargetsFromChangeLogFailed(f"bringing the targets up to date from the change log failed: "
                                             f"{self.error}") from self.error

    def wait_for(self, lsn: int, timeout: float) -> bool:
        """Until the targets hold the log up to ``lsn``; False on timeout or when the follower failed."""
        with self._idle:
            return self._idle.wait_for(lambda: self.error is not None or (
                self.applied_lsn is not None and self.applied_lsn >= lsn), timeout) and self.error is None

    def stop(self, timeout: float | None = None) -> None:
        """After the window being applied (the rest is applied on the next start)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)
