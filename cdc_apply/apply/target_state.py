"""Each target's Delta state, kept between batches so a batch pays Delta's fixed reads once at most.

A batch needs four things of a target before it writes: whether it exists, every writer's last
transaction version (Delta's SetTransactions: rebuilding them costs a Spark job after each new
commit), the source state in its properties (``DESCRIBE DETAIL``) and its column types. A
long-lived applier reads them once and keeps them (docs/architecture.md, invariant 13):

- An entry is trusted only while the Delta log's newest version is the one it was read at or the
  one this applier's own data commit made. Checking that lists the log and reads no table state.
- After a data commit, the entry moves to the new version only when the log grew by exactly that
  one commit and that commit is this applier's: its SetTransaction (or, for a snapshot chunk,
  which has none, its commit info) says so, read from the commit file.
  Anything else (a schema change, a second writer, a resync, a deleted table) drops the entry, and
  the next batch reads everything again.
- A new process starts with no entries: a restart trusts nothing it did not read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cdc_apply.apply.targets import SourceState, Target


@dataclass(frozen=True)
class TargetState:
    exists: bool
    log_version: int  # -1 when the table does not exist
    writers: dict[str, int] = field(default_factory=dict)  # app id -> last txnVersion
    source: SourceState | None = None
    data_types: dict[str, str] = field(default_factory=dict)


class TargetStates:
    """location -> the state last read or written there (one per applier; thread-safe per target)."""

    def __init__(self) -> None:
        self._entries: dict[str, TargetState] = {}
        self._lock = threading.Lock()

    def current(self, target: Target) -> TargetState:
        with self._lock:
            known = self._entries.get(target.location)
        if known is not None and target.log_version() == known.log_version:
            return known
        return self._read(target)

    def _read(self, target: Target) -> TargetState:
        log = target.log()  # the version, the writers and the properties of one log version, in one read
        if log.version < 0:
            self.forget(target)
            return TargetState(False, -1)
        writers = {app_id: writer.version for app_id, writer in log.writers.items()}
        state = TargetState(True, log.version, writers, target.source_state(log.configuration), target.data_types())
        with self._lock:
            self._entries[target.location] = state
        return state

    def wrote(self, target: Target, before: TargetState, app_id: str | None, txn_version: int,
              user_metadata: str) -> int | None:
        """After this applier's one data commit on ``before``, made with these commit confs: the
        log version it made, or None when the log holds more than that commit (nothing is kept)."""
        if before.exists:
            version = target.log_version()
            if version == before.log_version + 1 and target.commit_is(version, app_id, txn_version, user_metadata):
                writers = before.writers if app_id is None else {**before.writers, app_id: txn_version}
                after = TargetState(True, version, writers, before.source, before.data_types)
                with self._lock:
                    self._entries[target.location] = after
                return version
        self.forget(target)
        return None

    def forget(self, target: Target) -> None:
        with self._lock:
            self._entries.pop(target.location, None)
