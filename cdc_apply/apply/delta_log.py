"""What a path target's Delta log says, read by Python from the log's files (Delta's public protocol),
on any store ``Storage`` reaches, with no Spark and no Delta internals: a classic session and a Spark
Connect client read a target the same way, and so does `cdc-apply status`.

Read: the newest version, the table's properties (``metaData.configuration``) and every writer's
last ``txnVersion`` (``txn`` actions, Delta's SetTransaction). The newest checkpoint named by
``_last_checkpoint`` (classic, multi-part or V2, Parquet or JSON) is read once, then every commit
after it; a later read of the same table reads only the commits that came since (``LogState`` is
kept per location, process-wide). A log whose commits after the kept version were cleaned up is
read again from its checkpoint.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow.parquet as pq

from cdc_apply.lake.location import Location, Storage


@dataclass(frozen=True)
class WriterVersion:
    version: int
    last_updated_ms: int | None  # when the writer committed it (Delta's ``lastUpdated``)


@dataclass(frozen=True)
class LogState:
    """The table at one log version; ``version`` -1: no Delta table there."""

    version: int = -1
    configuration: dict[str, str] = field(default_factory=dict)
    writers: dict[str, WriterVersion] = field(default_factory=dict)
    newest_file: tuple[int | None, int | None] = (None, None)  # the size and mtime of commit ``version``

    def applying(self, version: int, actions: Iterable[dict[str, Any]]) -> LogState:
        configuration, writers = self.configuration, dict(self.writers)
        for action in actions:
            txn = action.get("txn")
            if txn and txn.get("appId") is not None:
                writers[str(txn["appId"])] = WriterVersion(int(txn["version"]), txn.get("lastUpdated"))
            metadata = action.get("metaData")
            if metadata:
                configuration = _as_dict(metadata.get("configuration"))
        return replace(self, version=version, configuration=configuration, writers=writers)


def _as_dict(entries: Any) -> dict[str, str]:
    """A Delta ``configuration``: a JSON object, or Parquet's map read as (key, value) pairs."""
    if not entries:
        return {}
    if isinstance(entries, dict):
        return {str(k): str(v) for k, v in entries.items()}
    return {str(k): str(v) for k, v in entries}


_states: dict[str, LogState] = {}
_states_lock = threading.Lock()


def log_state(table: str | Location, storage: Storage | None = None) -> LogState:
    """The table's newest state: the commits after the one read last for this location, else the
    newest checkpoint and every commit after it."""
    storage = storage or Storage()
    location = Location.parse(table)
    log_dir = location.child("_delta_log")
    entries = storage.entries(log_dir)
    names = sorted(entries)
    commits = sorted(int(name[:-5]) for name in names if name.endswith(".json") and name[:-5].isdigit())
    with _states_lock:
        known = _states.get(str(location))
    newest = commits[-1] if commits else -1
    newest_file = entries.get(f"{newest:020d}.json", (None, None))
    if known is not None and known.version == newest and known.newest_file == newest_file:
        return known
    # Kept state goes on only from the very commit file it read last (a table deleted and written
    # again at the location has other files under the same names).
    if known is None or known.version >= newest or known.version + 1 not in commits \
            or entries.get(f"{known.version:020d}.json", (None, None)) != known.newest_file:
        known = _from_checkpoint(storage, log_dir, names)
    state = known
    for number in commits:
        if number > state.version:
            state = state.applying(number, _json_actions(storage.read_text(log_dir.child(f"{number:020d}.json"))))
    state = replace(state, newest_file=newest_file)
    if state.version >= 0:
        with _states_lock:
            _states[str(location)] = state
    return state


def forget(table: str | Location) -> None:
    """Drop what is kept of ``table`` (it was deleted or replaced by another table at its location)."""
    with _states_lock:
        _states.pop(str(Location.parse(table)), None)


def _from_checkpoint(storage: Storage, log_dir: Location, names: list[str]) -> LogState:
    last = storage.read_text(log_dir.child("_last_checkpoint")) if "_last_checkpoint" in names else None
    if last is None:
        return LogState()
    version = int(json.loads(last)["version"])
    state = LogState()
    actions: list[dict[str, Any]] = []
    for name in sorted(n for n in names if n.startswith(f"{version:020d}.checkpoint")):
        if name.endswith(".parquet"):
            parquet = pq.ParquetFile(storage.input_file(log_dir.child(name)))
            columns = [c for c in ("txn", "metaData") if c in parquet.schema_arrow.names]
            table = parquet.read(columns=columns)
            for column in columns:
                actions += [{column: value} for value in table.column(column).to_pylist() if value]
        elif name.endswith(".json"):
            actions += _json_actions(storage.read_text(log_dir.child(name)))
    return state.applying(version, actions)


def commit_actions(table: str | Location, version: int, storage: Storage | None = None) -> list[dict[str, Any]]:
    """The actions of one commit ([] when that commit file is not there)."""
    storage = storage or Storage()
    return _json_actions(storage.read_text(Location.parse(table).child("_delta_log", f"{version:020d}.json")))


def writer_versions(table: str | Location, storage: Storage | None = None) -> dict[str, WriterVersion]:
    """app id -> its last version; {} when the location holds no Delta table."""
    return log_state(table, storage).writers


def _json_actions(text: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (text or "").splitlines() if line.strip()]
