"""Change rows of one table, in (commit_lsn, seq) order -> the final state per key.

Invariants (docs/architecture.md, "Invariants"):
- The result holds one entry per key: the last state of that key in the batch, an upsert or a delete.
- An update whose old key differs from its new key leaves a delete for the old key.
- A column sent as unchanged TOAST ('u') never becomes a placeholder: its value is taken from the
  full old image (REPLICA IDENTITY FULL), else from an earlier change of the same row in the batch,
  else it is marked ``from_target`` and MERGE keeps the target's value (of ``source_key`` when the
  row's key changed in this batch).
- A truncate forgets every earlier state; changes after it still apply.
- ``new_row`` holds when the key's first change in the batch is an insert, so the key is absent
  from the source, and therefore from the target, at the batch's start (a unique key and a target
  equal to the source then, which ``BatchApplier`` checks before it appends such a batch).

Images arrive keyed by source column names; ``column_map`` renames them to target columns
(None drops a column), so rows decoded under different Relation versions collapse together.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn

Key = tuple[Any, ...]


class FrozenList(tuple):  # type: ignore[type-arg]
    """An array value inside a key (a whole-row key of a table with an array or composite column):
    hashable; ``thaw`` gives the list back wherever a key's values leave the collapse."""


class FrozenStruct(tuple):  # type: ignore[type-arg]
    """A struct value (an interval) inside a key, as its (name, value) items."""


def freeze(value: Any) -> Any:
    if isinstance(value, list):
        return FrozenList(freeze(v) for v in value)
    if isinstance(value, dict):
        return FrozenStruct((k, freeze(v)) for k, v in value.items())
    return value


def thaw(value: Any) -> Any:
    if isinstance(value, FrozenList):
        return [thaw(v) for v in value]
    if isinstance(value, FrozenStruct):
        return {k: thaw(v) for k, v in value}
    return value


def key_image(columns: Sequence[str], key: Key) -> dict[str, Any]:
    """A key's values by column, as the change rows hold them."""
    return {column: thaw(value) for column, value in zip(columns, key)}
ColumnValues = dict[str, Any]


@dataclass(slots=True)
class KeyState:
    deleted: bool
    values: ColumnValues  # target column -> value; for a delete, only the key columns
    commit_lsn: int
    commit_ts: int  # microseconds since 1970, UTC
    from_target: tuple[str, ...] = ()  # columns whose value stays the target row's
    source_key: Key | None = None  # the target row that supplies from_target, when not this key
    new_row: bool = False  # the key's first change in this batch is an insert


@dataclass(frozen=True, slots=True)
class TruncateMark:
    commit_lsn: int
    commit_ts: int
    options: int


@dataclass
class Collapsed:
    key_columns: tuple[str, ...]
    states: dict[Key, KeyState] = field(default_factory=dict)
    truncate: TruncateMark | None = None
    op_counts: Counter[str] = field(default_factory=Counter)
    first_lsn: int | None = None
    last_lsn: int | None = None
    # Whole-row keys (REPLICA IDENTITY FULL without a configured key): how many rows of each key the
    # batch adds (> 0) or removes (< 0); None for ordinary keys, where a key is one row.
    multiplicity: dict[Key, int] | None = None

    @property
    def new_rows_only(self) -> bool:
        """Every key is absent from the target at the batch's start: an append writes the batch."""
        return self.truncate is None and all(state.new_row for state in self.states.values())

    def needs_target_rows(self) -> dict[Key, list[Key]]:
        """source key -> the keys whose unchanged TOAST values come from that other target row."""
        wanted: dict[Key, list[Key]] = {}
        for key, state in self.states.items():
            if state.from_target and state.source_key is not None:
                wanted.setdefault(state.source_key, []).append(key)
        return wanted


class Collapser:
    def __init__(self, table: str, key_columns: tuple[str, ...]) -> None:
        self.table = table
        self.result = Collapsed(key_columns)
        self._key_columns = key_columns
        self._row_numbers = itertools.count()

    def _counted(self, row: Mapping[str, Any]) -> bool:
        """Counts the change and spans the batch's LSNs; True when it was a truncate (applied here)."""
        op, lsn = row["op"], row["commit_lsn"]
        result = self.result
        result.op_counts[op] += 1
        if result.first_lsn is None:
            result.first_lsn = lsn
        result.last_lsn = lsn
        if op == "T":
            self._truncate(TruncateMark(lsn, row["commit_ts"], row["truncate_options"] or 0))
        return op == "T"

    def add(self, row: Mapping[str, Any], column_map: Mapping[str, str | None] | None = None) -> None:
        if self._counted(row):
            return
        op = row["op"]
        lsn, ts = row["commit_lsn"], row["commit_ts"]
        if op != "I" and not self._key_columns:
            raise CdcApplyError(
                f"{self.table}, LSN {format_lsn(lsn)} (transaction {row['xid']}, change {row['seq']}): an "
                f"{'update' if op == 'U' else 'delete'} of a table without a key (applied insert-only); "
                "set tables.<name>.keys in the config or give the table a primary key")
        new = _renamed(row["new"], column_map)
        full_old = _renamed(row["old"], column_map)
        identity = full_old or _renamed(row["key"], column_map)
        if op == "I":
            # Without a key (REPLICA IDENTITY NOTHING) every insert is its own row.
            key = self._key(new, row, "new") if self._key_columns else (next(self._row_numbers),)
            earlier = self.result.states.get(key)
            self._set(key, KeyState(False, new, lsn, ts, new_row=earlier is None or earlier.new_row))
        elif op == "D":
            key = self._key(identity, row, "old")
            earlier = self.result.states.get(key)
            self._set(key, KeyState(True, self._key_image(key), lsn, ts, new_row=earlier is not None and earlier.new_row))
        else:
            self._update(row, new, full_old, identity, column_map)

    def _update(self, row: Mapping[str, Any], new: ColumnValues, full_old: ColumnValues | None, identity: ColumnValues | None,
                column_map: Mapping[str, str | None] | None) -> None:
        states = self.result.states
        lsn, ts = row["commit_lsn"], row["commit_ts"]
        new_key = self._key(new, row, "new")
        old_key = new_key
        if identity is not None and all(k in identity for k in self._key_columns):
            old_key = self._key(identity, row, "old")
        key_changed = old_key != new_key
        previous = states.pop(old_key, None) if key_changed else states.get(new_key)
        if key_changed:
            self._set(old_key, KeyState(True, self._key_image(old_key), lsn, ts,
                                        new_row=previous is not None and previous.new_row))
        if previous is not None and not previous.deleted:
            for name, value in previous.values.items():
                new.setdefault(name, value)  # target columns the current source no longer has
        unchanged = [name for name in (_rename(n, column_map) for n in row["unchanged"]) if name]
        from_target: tuple[str, ...] = ()
        source_key: Key | None = None
        if unchanged:
            if full_old is not None:
                for name in unchanged:
                    new[name] = full_old.get(name)
            elif previous is not None and not previous.deleted:
                for name in unchanged:
                    new[name] = previous.values.get(name)
                from_target = tuple(n for n in unchanged if n in previous.from_target)
                source_key = previous.source_key if previous.source_key is not None else old_key
            elif previous is None and self.result.truncate is None:
                from_target = tuple(unchanged)
                source_key = old_key
            else:
                raise CdcApplyError(
                    f"{self.table}, LSN {format_lsn(lsn)} (transaction {row['xid']}, change {row['seq']}): "
                    f"update sends unchanged TOAST columns {unchanged} but the row has no earlier value "
                    "in this batch and the target was truncated or deleted it")
            if source_key == new_key:
                source_key = None
        # A key changed to one the batch has not seen is absent at the start too (PostgreSQL's key is unique).
        new_row = previous is not None and previous.new_row and (not key_changed or new_key not in states)
        self._set(new_key, KeyState(False, new, lsn, ts, from_target, source_key, new_row))

    def _set(self, key: Key, state: KeyState) -> None:
        self.result.states[key] = state

    def _truncate(self, mark: TruncateMark) -> None:
        self.result.states.clear()
        if self.result.multiplicity is not None:
            self.result.multiplicity.clear()
        self.result.truncate = mark

    def rename_columns(self, renamed: Mapping[str, str]) -> None:
        """Target columns renamed by a schema change inside this batch: earlier states follow."""
        for state in self.result.states.values():
            state.values = {renamed.get(name, name): value for name, value in state.values.items()}
            state.from_target = tuple(renamed.get(name, name) for name in state.from_target)
        self._key_columns = tuple(renamed.get(name, name) for name in self._key_columns)
        self.result.key_columns = self._key_columns

    @property
    def key_columns(self) -> tuple[str, ...]:
        return self._key_columns

    def add_key(self, key_columns: tuple[str, ...]) -> None:
        """An insert-only table got a key inside this batch: its rows so far are keyed by it (they
        are unique on it, or PostgreSQL would have refused the key)."""
        if self._key_columns:
            raise CdcApplyError(f"{self.table}: key columns changed from {list(self._key_columns)} to "
                                f"{list(key_columns)}; copy the table again (docs/apply.md)")
        self._key_columns = key_columns
        self.result.key_columns = key_columns
        states = list(self.result.states.values())
        self.result.states = {}
        for state in states:
            key = tuple(state.values.get(k) for k in key_columns)
            self._set(key, state)

    def rekeyed(self, key_columns: tuple[str, ...], target_rows: Mapping[Key, ColumnValues]) -> Collapser:
        """The batch so far under another key: a replica identity switch inside the batch (a USING
        INDEX of other columns, a whole-row key that became a primary key; docs/apply.md, "Keys").

        ``target_rows`` are the target's rows at the batch's start by the current key (also those that
        supply unchanged TOAST values). PostgreSQL's new key is unique at the switch, so each row the
        batch leaves takes the new key of its values, and the target row its old key named is deleted
        under that row's new key first: a row whose new key another row took is replaced by it.
        """
        rekeyed = Collapser(self.table, key_columns)
        old = self.result
        rekeyed.result = Collapsed(key_columns, truncate=old.truncate, op_counts=old.op_counts,
                                   first_lsn=old.first_lsn, last_lsn=old.last_lsn)

        def new_key(values: Mapping[str, Any]) -> Key | None:
            return tuple(values[k] for k in key_columns) if all(k in values for k in key_columns) else None

        for old_key, state in old.states.items():
            gone = new_key(target_rows.get(old_key) or self._key_image(old_key))
            if gone is not None:  # None: the old key names no target row (a row of this batch)
                rekeyed._set(gone, KeyState(True, rekeyed._key_image(gone), state.commit_lsn, state.commit_ts))
        for old_key, state in old.states.items():
            if state.deleted:
                continue
            values = dict(state.values)
            if state.from_target:
                source = target_rows.get(state.source_key or old_key, {})
                values.update((name, source.get(name)) for name in state.from_target)
            key = new_key(values)
            if key is None:
                raise CdcApplyError(f"{self.table}, LSN {format_lsn(state.commit_lsn)}: a row has no value for the "
                                    f"new key columns {list(key_columns)}")
            rekeyed._set(key, KeyState(False, values, state.commit_lsn, state.commit_ts))
        return rekeyed

    def _key(self, image: ColumnValues | None, row: Mapping[str, Any], which: str) -> Key:
        try:
            return tuple(freeze(image[k]) for k in self._key_columns)  # type: ignore[index]
        except (KeyError, TypeError):
            raise CdcApplyError(
                f"{self.table}, LSN {format_lsn(row['commit_lsn'])} (transaction {row['xid']}, change "
                f"{row['seq']}): the {which} image has no value for key columns {list(self._key_columns)}; "
                "keys set in the config must be replica identity columns") from None

    def _key_image(self, key: Key) -> ColumnValues:
        return key_image(self._key_columns, key)


class MultisetCollapser(Collapser):
    """REPLICA IDENTITY FULL without a unique key: PostgreSQL keeps identical rows apart, so the key
    is the whole row and the batch's result per key is a count of rows added or removed, besides the
    row's values. An UPDATE or DELETE of one of n identical rows changes exactly one of them."""

    def __init__(self, table: str, key_columns: tuple[str, ...]) -> None:
        super().__init__(table, key_columns)
        self.result.multiplicity = {}

    def add(self, row: Mapping[str, Any], column_map: Mapping[str, str | None] | None = None) -> None:
        if self._counted(row):
            return
        op = row["op"]
        lsn, ts = row["commit_lsn"], row["commit_ts"]
        counts = self.result.multiplicity
        assert counts is not None
        old = _renamed(row["old"], column_map) or _renamed(row["key"], column_map)
        if op in ("U", "D"):
            key = self._key(old, row, "old")
            counts[key] = counts.get(key, 0) - 1
            self._set(key, KeyState(True, key_image(self._key_columns, key), lsn, ts))
        if op in ("I", "U"):
            new = _renamed(row["new"], column_map) or {}
            for name in (n for n in (_rename(c, column_map) for c in row["unchanged"]) if n):
                new[name] = (old or {}).get(name)  # unchanged TOAST: the full old row holds it
            key = self._key(new, row, "new")
            counts[key] = counts.get(key, 0) + 1
            self._set(key, KeyState(False, new, lsn, ts))

    def add_key(self, key_columns: tuple[str, ...]) -> None:
        """The whole row grew (a column added inside the batch): earlier rows lack it (NULL)."""
        counts = self.result.multiplicity
        assert counts is not None
        states = list(self.result.states.items())
        previous = self._key_columns
        self._key_columns = key_columns
        self.result.key_columns = key_columns
        self.result.states, self.result.multiplicity = {}, {}
        for key, state in states:
            values = dict(zip(previous, key))
            new_key = tuple(values.get(k) for k in key_columns)
            self.result.multiplicity[new_key] = self.result.multiplicity.get(new_key, 0) + counts.get(key, 0)
            self._set(new_key, state)


def _rename(name: str, column_map: Mapping[str, str | None] | None) -> str | None:
    return name if column_map is None else column_map.get(name, name)


def _renamed(image: ColumnValues | None, column_map: Mapping[str, str | None] | None) -> ColumnValues | None:
    if image is None:
        return None
    if column_map is None:
        return dict(image)
    out: ColumnValues = {}
    for name, value in image.items():
        target = column_map.get(name, name)
        if target is not None:
            out[target] = value
    return out
