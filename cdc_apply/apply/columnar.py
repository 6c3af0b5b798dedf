"""The collapse as column operations: Arrow change rows -> the MERGE source, with no Python values.

It gives what ``apply/collapse.py`` gives (one row per key: the key's last state in the batch), for
the common case, and returns None for the rest, which take the row-by-row collapse:

- the segment is one Relation definition that the column-at-a-time parse takes (``segment_rows``:
  read from the stream, or a snapshot chunk);
- inserts, updates and deletes only (no truncate), of a table with a key, or inserts only without one;
- a column sent as unchanged TOAST in a key's last change is taken from the full old image, else
  from the key's latest earlier change in the batch that holds it, else kept from the target row
  (no change of the key in the batch touched it); a value that would come from another key's row
  (a row moved to the key), or a key column sent as unchanged TOAST, takes the row-by-row collapse;
- every value fits its target column, and the key columns can be grouped (no floating point, whose
  -0 and NaN Arrow groups otherwise than PostgreSQL's equality).

Each change row is an event of its key (the new image's for inserts and updates, the old image's
for deletes), and an update that changes its key is also a delete event of the old key. The last
state of a key is its last event: rows come in (commit LSN, seq) order, so the largest row index
per key is taken. ``new_rows_only`` holds when every key was absent at the batch's start: its
first event is an insert, or an update that moved a row to it (PostgreSQL's unique key says it was
absent then, and no earlier change in the batch could have removed it).
tests/test_columnar_collapse.py holds the result equal to the row-by-row collapse's, and
tests/test_apply_semantics.py the Delta table equal to PostgreSQL's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.arrow_nulls import null_array
from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS, KEEP, OP
from cdc_apply.changerows.columns import NotArrowRepresentable
from cdc_apply.changerows.run_rows import RunRows
from cdc_apply.changerows.segments import TableChanges
from cdc_apply.pgtypes.sparktypes import arrow_type

_ARROW_FAILURES = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError)


@dataclass(frozen=True)
class CollapsedColumns:
    """One row per key, as target columns plus ``OP``, ``KEEP``, the commit LSN and timestamp."""

    columns: dict[str, pa.Array]
    keys_written: int
    op_counts: Counter[str]
    first_lsn: int
    last_lsn: int
    new_rows_only: bool
    kept: frozenset[str]  # target columns some upsert leaves as the target holds them (in its ``KEEP``)


def segment_rows(segment: TableChanges) -> pa.Table | None:
    """The segment's change rows as Arrow, when the column-at-a-time parse takes it (``Segment.columnar``)
    and Arrow holds its values."""
    if not segment.columnar or (bool((segment.changes.ops() == ord("T")).any()) if isinstance(segment.changes, RunRows)
                                else any(change.op == "T" for change in segment.changes)):
        return None
    try:
        return segment.to_arrow()
    except NotArrowRepresentable:
        return None


def collapsed_columns(table: pa.Table, after_lsn: int | None, column_map: Mapping[str, str | None],
                      keys: tuple[str, ...], data_types: Mapping[str, str]) -> CollapsedColumns | None:
    """Change rows of one Relation definition (``change_row_schema``) after ``after_lsn``, collapsed
    per key; None when the row-by-row collapse must take them (see the module docstring) or there are none."""
    if after_lsn is not None and table.num_rows and pc.min(table["commit_lsn"]).as_py() <= after_lsn:  # a filter copies
        table = table.filter(pc.greater(table["commit_lsn"], pa.scalar(after_lsn, pa.int64())))
    count = table.num_rows
    if count == 0:
        return None
    ops = set(pc.unique(table["op"]).to_pylist())
    if not ops <= {"I", "U", "D"} or (not keys and ops != {"I"}):
        return None
    op = _whole(table.column("op"))
    images = _Images(table)
    source_of = {target: source for source, target in column_map.items() if target is not None}
    try:
        events = _key_events(images, op, [source_of[k] for k in keys]) if keys else _Events.one_per_row(op)
        if events is None:
            return None
        last, first = events.last_and_first(len(keys))
        rows = events.row[last]
        final_kind = events.kind.take(pa.array(last))
        first_new = np.asarray(pc.equal(events.kind.take(pa.array(first)), "I").to_numpy(zero_copy_only=False), bool)
        new_rows_only = bool((first_new | events.moved[first]).all())
        upserts = pc.not_equal(final_kind, "D")
        toast = _unchanged_toast(table, images, events, last, last == first, upserts, {source_of[k] for k in keys})
        if toast is None:
            return None
        columns: dict[str, pa.Array] = {}
        keep: dict[str, np.ndarray] = {}  # target column -> the result rows whose upsert keeps the target's value
        take_rows = _taker(rows, count)
        for target, spark_type in data_types.items():
            kind = arrow_type(spark_type)
            source = source_of.get(target)
            if target in keys:
                columns[target] = events.keys[keys.index(target)].take(pa.array(last)).cast(kind)
            elif source is None:  # a target column the source no longer has: the upsert keeps the target's value
                columns[target] = null_array(len(last), kind)
                keep[target] = np.ones(len(last), bool)
            elif source in toast:
                held = toast[source]
                value_rows = pa.array(held.rows)
                values = pc.if_else(pa.array(held.from_old), images.old[source].take(value_rows),
                                    images.new[source].take(value_rows))
                columns[target] = values.cast(kind)
                keep[target] = held.kept
            else:
                columns[target] = take_rows(images.new[source]).cast(kind)
    except _ARROW_FAILURES:
        return None
    upsert_mask = np.asarray(upserts.to_numpy(zero_copy_only=False), bool)
    columns[OP] = pc.if_else(upserts, "U", "D").cast(pa.string())
    columns[KEEP] = _keep_lists(keep, upsert_mask)
    columns[COMMIT_LSN] = take_rows(_whole(table.column("commit_lsn")))
    columns[COMMIT_TS] = take_rows(_whole(table.column("commit_ts")))
    lsns = table.column("commit_lsn")
    op_counts = Counter({str(entry["values"]): int(entry["counts"]) for entry in pc.value_counts(op).to_pylist()})
    kept_columns = frozenset(name for name, rows_kept in keep.items() if (rows_kept & upsert_mask).any())
    return CollapsedColumns(columns, len(last), op_counts, lsns[0].as_py(), lsns[count - 1].as_py(), new_rows_only,
                            kept_columns)


def _whole(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array, with no copy when it is one chunk already (a batch holds its values
    once; each copy of a large insert batch costs its whole size again)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _taker(rows: np.ndarray, count: int) -> Callable[[pa.Array], pa.Array]:
    """Takes ``rows`` of a column of ``count``; no copy when they are every row in order (inserts of new keys)."""
    if len(rows) == count and np.array_equal(rows, np.arange(count)):
        return lambda values: values
    indices = pa.array(rows)
    return lambda values: values.take(indices)


class _Images:
    """The change rows' new, old and key images, each as columns by source name (null where absent)."""

    def __init__(self, table: pa.Table) -> None:
        new, old, key = (_whole(table.column(name)) for name in ("new", "old", "key"))
        self.new, self.old, self.key = _fields(new), _fields(old), _fields(key)
        self.old_present, self.key_present = old.is_valid(), key.is_valid()


@dataclass
class _Events:
    """Per event: its change row, its kind (I, U or D) and key; ``moved``: an upsert whose row came
    from another key. Events of row i have order 2i, and 2i + 1 for the delete of a changed key."""

    row: np.ndarray
    kind: pa.Array
    keys: list[pa.Array]
    moved: np.ndarray
    order: np.ndarray

    @staticmethod
    def one_per_row(op: pa.Array) -> _Events:
        count = len(op)
        return _Events(np.arange(count), op, [], np.zeros(count, bool), np.arange(count) * 2)

    def last_and_first(self, key_count: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions of each key's last and first event (no key: every event is its own)."""
        if not key_count:
            positions = np.arange(len(self.row))
            return positions, positions
        position_of = np.empty(int(self.order.max()) + 1, np.int64)
        position_of[self.order] = np.arange(len(self.order))
        grouped = pa.table({**{f"k{i}": c for i, c in enumerate(self.keys)}, "_order": self.order}) \
            .group_by([f"k{i}" for i in range(key_count)], use_threads=False) \
            .aggregate([("_order", "max"), ("_order", "min")])
        return (position_of[grouped["_order_max"].to_numpy()], position_of[grouped["_order_min"].to_numpy()])


def _key_events(images: _Images, op: pa.Array, sources: list[str]) -> _Events | None:
    """The events of keyed change rows; None when a key column cannot be grouped."""
    deletes, updates = pc.equal(op, "D"), pc.equal(op, "U")
    identities, news = [], []
    moved = pa.array(np.zeros(len(op), bool))
    for source in sources:
        new_value = images.new[source]
        if pa.types.is_floating(new_value.type) or source not in images.key:
            return None
        identity = pc.if_else(images.old_present, images.old[source],
                              pc.if_else(images.key_present, images.key[source], new_value))
        same = pc.or_kleene(pc.equal(identity, new_value), pc.and_(pc.is_null(identity), pc.is_null(new_value)))
        moved = pc.or_(moved, pc.and_(updates, pc.invert(pc.fill_null(same, False))))
        identities.append(identity)
        news.append(new_value)
    changed = np.flatnonzero(moved.to_numpy(zero_copy_only=False))
    count = len(op)
    row = np.concatenate([np.arange(count), changed])
    keys = [pa.concat_arrays([pc.if_else(deletes, identity, new_value), identity.take(pa.array(changed))])
            for identity, new_value in zip(identities, news)]
    kind = pa.concat_arrays([op, pa.array(["D"] * len(changed), pa.string())])
    moved_events = np.concatenate([moved.to_numpy(zero_copy_only=False), np.zeros(len(changed), bool)])
    order = np.concatenate([np.arange(count) * 2, changed * 2 + 1])
    return _Events(row, kind, keys, moved_events, order)


def _unchanged_toast(table: pa.Table, images: _Images, events: _Events, last: np.ndarray, only_event: np.ndarray,
                     upserts: pa.Array, key_sources: set[str]) -> dict[str, _ToastValues] | None:
    """Per source column sent as unchanged TOAST in some key's last change: where each result row's
    value comes from. In order: the last change's full old image; else the key's latest earlier
    change in the batch that holds the value (an insert, an update that sent it, or one with a full
    old image); else, when no change of the key touched it, the target row's value (kept). None when
    the value would come from another key's row (a row moved to this key, or a key column is
    unchanged TOAST): the row-by-row collapse finds it there or names the change it cannot key."""
    unchanged = _whole(table.column("unchanged"))
    names = unchanged.flatten()
    if len(names) == 0:
        return {}
    if key_sources & set(names.to_pylist()):
        return None
    rows = events.row[last]
    parents = pc.list_parent_indices(unchanged).to_numpy()
    names_np = np.asarray(names.to_pylist(), dtype=object)
    old_present_by_row = np.asarray(images.old_present.to_numpy(zero_copy_only=False), bool)
    old_present = old_present_by_row[rows]
    upsert_mask = np.asarray(upserts.to_numpy(zero_copy_only=False), bool)
    moved = events.moved[last]
    toast: dict[str, _ToastValues] = {}
    history: _KeyHistory | None = None
    for name in set(names_np):
        missing = np.zeros(len(table), bool)
        missing[parents[names_np == name]] = True
        affected = missing[rows] & upsert_mask
        if not affected.any():
            continue
        from_old = affected & old_present
        kept = affected & ~old_present
        if (kept & moved).any():
            return None
        value_rows = rows.copy()
        earlier = kept & ~only_event
        if earlier.any():
            history = history or _KeyHistory(events)
            found = history.latest_holder(missing, old_present_by_row, last[earlier])
            if found is None:
                return None
            holder_rows, holder_from_old, held = found
            value_rows[earlier] = np.where(held, holder_rows, value_rows[earlier])
            from_old[earlier] = held & holder_from_old
            kept[earlier] = ~held
        toast[name] = _ToastValues(value_rows, from_old, kept)
    return toast


@dataclass(frozen=True)
class _ToastValues:
    """An unchanged-TOAST column's value per result row: from change row ``rows`` (its old image where
    ``from_old``, else its new), or the target's where ``kept``."""

    rows: np.ndarray
    from_old: np.ndarray
    kept: np.ndarray


class _KeyHistory:
    """Each key's events in stream order (``events`` positions, one run per key)."""

    def __init__(self, events: _Events) -> None:
        in_order = np.argsort(events.order, kind="stable")
        grouped = pa.table({**{f"k{i}": c.take(pa.array(in_order)) for i, c in enumerate(events.keys)},
                            "_position": in_order}) \
            .group_by([f"k{i}" for i in range(len(events.keys))], use_threads=False) \
            .aggregate([("_position", "list")])
        runs = _whole(grouped["_position_list"])
        self.positions = runs.flatten().to_numpy()
        offsets = runs.offsets.to_numpy()
        self.run_start = np.repeat(offsets[:-1], np.diff(offsets))  # per flat index: where its key's run starts
        self.index_of = np.empty(len(self.positions), np.int64)  # event position -> flat index
        self.index_of[self.positions] = np.arange(len(self.positions))
        self.kinds = np.asarray(events.kind.to_numpy(zero_copy_only=False), dtype=object)[self.positions]
        self.rows = events.row[self.positions]
        self.moved = events.moved[self.positions]

    def latest_holder(self, unchanged: np.ndarray, old_present: np.ndarray,
                      last_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """For keys whose last event (``last_positions``) sent the column as unchanged TOAST without a
        full old image: the change row of the latest earlier event that holds its value, whether that
        value is in its old image, and whether there is one at all (none: the target's value stands).
        None when such a value would come from elsewhere: a row moved to the key, or a delete."""
        kinds, rows = self.kinds, self.rows
        sent = ~unchanged[rows]
        with_old = unchanged[rows] & old_present[rows]
        holds = (kinds == "I") | ((kinds == "U") & (sent | with_old))
        blocks = (kinds == "D") | ((kinds == "U") & ~holds & self.moved)
        marked = np.where(holds | blocks, np.arange(len(self.positions)), -1)
        latest = np.maximum.accumulate(marked) if len(marked) else marked
        ends = self.index_of[last_positions]
        before = np.where(ends > self.run_start[ends], latest[np.maximum(ends - 1, 0)], -1)
        before = np.where(before >= self.run_start[ends], before, -1)
        found = before >= 0
        if blocks[before[found]].any():
            return None
        holder = np.where(found, before, 0)
        return rows[holder], with_old[holder] & found, found


def _keep_lists(keep: Mapping[str, np.ndarray], upserts: np.ndarray) -> pa.Array:
    """The MERGE source's ``_cdc_keep``: per upsert, the target columns whose value stays the target's."""
    list_type = pa.list_(pa.string())
    if not keep:
        return null_array(len(upserts), list_type)
    names = list(keep)
    if all(mask.all() for mask in keep.values()):  # the common case: the same columns for every row
        return pc.if_else(pa.array(upserts), pa.scalar(names, list_type), pa.scalar(None, list_type))
    lists: list[list[str] | None] = [None] * len(upserts)
    for index in np.flatnonzero(upserts):
        kept = [name for name in names if keep[name][index]]
        lists[index] = kept or None
    return pa.array(lists, list_type)


def _fields(image: pa.StructArray) -> dict[str, pa.Array]:
    """An image's columns by name, null where the image is absent."""
    return {field.name: values for field, values in zip(image.type, image.flatten())}
