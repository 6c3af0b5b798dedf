"""SCD type 2 targets: every change becomes a version row with ``_cdc_valid_from/_cdc_valid_to/_cdc_current``.

Invariants:
- Per key, at most one row has ``_cdc_current = true``: the MERGE closes the target's current row
  at the key's first change in the batch (or at the batch's truncate, if that came first) and
  inserts the batch's versions, of which only the last can be current.
- Several changes of one key in one transaction make one version (the transaction's last state).
- A delete, a key change away from the key, and a truncate end the current version; nothing is
  removed.
- Unchanged TOAST values follow the same rules as SCD 1 (``collapse.py``); values that must come
  from the target are read from its current row before the MERGE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from cdc_apply.apply.collapse import ColumnValues, Collapser, Key, KeyState, TruncateMark, key_image
from cdc_apply.apply.merge import OP, arrow_column, fetch_target_rows, typed_frame
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.staging import staging_scope
from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS, CURRENT, VALID_FROM, VALID_TO
from cdc_apply.apply.targets import Target, quote
from cdc_apply.errors import CdcApplyError

CLOSE_TS = "_cdc_close_ts"


@dataclass
class Timeline:
    close_target_at: int  # when the target's current row of this key ends (microseconds)
    entries: list[KeyState]  # versions and ends (deleted states), in order


class HistoryCollapser(Collapser):
    def __init__(self, table: str, key_columns: tuple[str, ...]) -> None:
        super().__init__(table, key_columns)
        self.timelines: dict[Key, Timeline] = {}

    def add_key(self, key_columns: tuple[str, ...]) -> None:
        timelines = list(self.timelines.values())
        super().add_key(key_columns)
        self.timelines = {tuple(t.entries[-1].values.get(k) for k in key_columns): t for t in timelines}

    def rekeyed(self, key_columns: tuple[str, ...], target_rows: Mapping[Key, ColumnValues]) -> Collapser:
        raise CdcApplyError(f"{self.table}: key columns changed from {list(self.key_columns)} to {list(key_columns)} "
                            "inside one batch, which SCD type 2 cannot follow; apply it in smaller batches "
                            "(batching.max_changes) or copy the table again")

    def _set(self, key: Key, state: KeyState) -> None:
        super()._set(key, state)
        timeline = self.timelines.get(key)
        if timeline is None:
            truncate = self.result.truncate
            self.timelines[key] = Timeline(truncate.commit_ts if truncate else state.commit_ts, [state])
            return
        last = timeline.entries[-1]
        if last.commit_lsn == state.commit_lsn and not last.deleted:
            timeline.entries.pop()  # one version per transaction: its last state
        if state.deleted and timeline.entries and timeline.entries[-1].deleted:
            return
        timeline.entries.append(state)

    def _truncate(self, mark: TruncateMark) -> None:
        super()._truncate(mark)
        for timeline in self.timelines.values():
            if not timeline.entries[-1].deleted:
                timeline.entries.append(KeyState(True, {}, mark.commit_lsn, mark.commit_ts))

    def rename_columns(self, renamed: Mapping[str, str]) -> None:
        super().rename_columns(renamed)
        for timeline in self.timelines.values():
            for entry in timeline.entries:
                entry.values = {renamed.get(name, name): value for name, value in entry.values.items()}
                entry.from_target = tuple(renamed.get(name, name) for name in entry.from_target)


@dataclass
class Version:
    key: Key
    state: KeyState
    valid_to: int | None


def versions(collapser: HistoryCollapser) -> list[Version]:
    found = []
    for key, timeline in collapser.timelines.items():
        entries = timeline.entries
        for i, entry in enumerate(entries):
            if not entry.deleted:
                found.append(Version(key, entry, entries[i + 1].commit_ts if i + 1 < len(entries) else None))
    return found


def _fill_from_target(target: Target, keys: Sequence[str], found: list[Version]) -> None:
    wanted = {v.state.source_key or v.key for v in found if v.state.from_target}
    if not wanted:
        return
    rows = fetch_target_rows(target, keys, wanted, where=f"{CURRENT}")
    for version in found:
        state = version.state
        if state.from_target:
            row = rows.get(state.source_key or version.key, {})
            for name in state.from_target:
                state.values[name] = row.get(name)
            state.from_target = ()


def merge_history(target: Target, collapser: HistoryCollapser, data_types: Mapping[str, str],
                  keys: Sequence[str], commit: DataCommit) -> None:
    spark = target.spark
    found = versions(collapser)
    _fill_from_target(target, keys, found)
    closes = [(key, timeline.close_target_at) for key, timeline in collapser.timelines.items()]
    columns: dict[str, list[Any]] = {name: [] for name in data_types}
    for key, _ in closes:
        image = key_image(keys, key)
        for name, column in columns.items():
            column.append(image.get(name))
    for item in found:
        for name, column in columns.items():
            column.append(item.state.values.get(name))
    arrays = {name: arrow_column(name, values, data_types[name]) for name, values in columns.items()}
    arrays[OP] = pa.array(["C"] * len(closes) + ["I"] * len(found), pa.string())
    arrays[CLOSE_TS] = pa.array([ts for _, ts in closes] + [None] * len(found), pa.timestamp("us", tz="UTC"))
    arrays[COMMIT_LSN] = pa.array([None] * len(closes) + [v.state.commit_lsn for v in found], pa.int64())
    arrays[COMMIT_TS] = pa.array([None] * len(closes) + [v.state.commit_ts for v in found],
                                 pa.timestamp("us", tz="UTC"))
    arrays[VALID_TO] = pa.array([None] * len(closes) + [v.valid_to for v in found], pa.timestamp("us", tz="UTC"))
    with staging_scope():  # the staged source lives until the MERGE has run
        source = typed_frame(spark, arrays, data_types, target.staging)
        condition = f"s.{OP} = 'C' AND t.{CURRENT} AND " + " AND ".join(f"t.{quote(k)} <=> s.{quote(k)}" for k in keys)
        inserts = {quote(n): f"s.{quote(n)}" for n in data_types} | {
            quote(COMMIT_LSN): f"s.{COMMIT_LSN}", quote(COMMIT_TS): f"s.{COMMIT_TS}",
            quote(VALID_FROM): f"s.{COMMIT_TS}", quote(VALID_TO): f"s.{VALID_TO}",
            quote(CURRENT): f"s.{VALID_TO} IS NULL"}
        merge = (target.merge(source, condition)
                 .when_matched_update(None, {quote(VALID_TO): f"s.{CLOSE_TS}", quote(CURRENT): "false"})
                 .when_not_matched_insert(f"s.{OP} = 'I'", inserts))
        truncate = collapser.result.truncate
        if truncate is not None:
            merge = merge.when_not_matched_by_source_update(
                f"t.{CURRENT}", {quote(VALID_TO): f"timestamp_micros({truncate.commit_ts})", quote(CURRENT): "false"})
        with commit.checked(spark):
            merge.execute()
