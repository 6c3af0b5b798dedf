"""The collapse as column operations: Arrow change rows -> the MERGE source, with no Python values.

It gives what ``apply/collapse.py`` gives (one row per key: the key's last state in the batch), for
the common case, and returns None for the rest, which take the row-by-row collapse:

- the segment was read from the stream (``segment_rows``: one Relation definition, every change with its bytes);
- inserts, updates and deletes only (no truncate), of a table with a key, or inserts only without one;
- no update changes its key and none sends unchanged TOAST values;
- every value fits its target column, and the key columns can be grouped (no floating point, whose
  -0 and NaN Arrow groups otherwise than PostgreSQL's equality).

The last state of a key is its last change: rows come in (commit LSN, seq) order, so the largest row
index per key is taken. ``new_rows_only`` holds when every key's first change is an insert (the key
is absent at the batch's start, as in ``Collapsed.new_rows_only``). tests/test_type_delta.py and
tests/test_apply_semantics.py hold both paths equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS, KEEP, OP
from cdc_apply.changerows.columns import NotArrowRepresentable
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
    kept: frozenset[str]  # target columns an upsert leaves as the target holds them (the source lacks them)


def segment_rows(segment: TableChanges) -> pa.Table | None:
    """The segment's change rows as Arrow, when it was read from the stream and Arrow holds its values."""
    if not segment.from_stream or any(change.op == "T" for change in segment.changes):
        return None
    try:
        return segment.to_arrow()
    except NotArrowRepresentable:
        return None


def collapsed_columns(table: pa.Table, after_lsn: int | None, column_map: Mapping[str, str | None],
                      keys: tuple[str, ...], data_types: Mapping[str, str]) -> CollapsedColumns | None:
    """Change rows of one Relation definition (``change_row_schema``) after ``after_lsn``, collapsed
    per key; None when the row-by-row collapse must take them (see the module docstring) or there are none."""
    if after_lsn is not None:
        table = table.filter(pc.greater(table["commit_lsn"], pa.scalar(after_lsn, pa.int64())))
    count = table.num_rows
    if count == 0 or pc.sum(pc.list_value_length(table["unchanged"])).as_py():
        return None
    ops = set(pc.unique(table["op"]).to_pylist())
    if not ops <= {"I", "U", "D"} or (not keys and ops != {"I"}):
        return None
    op = table.column("op").combine_chunks()
    new_fields = _fields(table.column("new").combine_chunks())
    source_of = {target: source for source, target in column_map.items() if target is not None}
    try:
        last = pa.array(np.arange(count, dtype=np.int64))
        new_rows_only = True
        if keys:
            key_columns = _row_keys(table, op, new_fields, [source_of[k] for k in keys])
            if key_columns is None:
                return None
            grouped = pa.table({**{f"k{i}": c for i, c in enumerate(key_columns)}, "_row": last}) \
                .group_by([f"k{i}" for i in range(len(keys))], use_threads=False) \
                .aggregate([("_row", "max"), ("_row", "min")])
            last = grouped["_row_max"].combine_chunks()
            new_rows_only = bool(pc.all(pc.equal(op.take(grouped["_row_min"]), "I")).as_py())
            key_values = {k: c.take(last) for k, c in zip(keys, key_columns)}
        else:
            key_values = {}
        final_op = pc.if_else(pc.equal(op.take(last), "D"), "D", "U")
        columns: dict[str, pa.Array] = {}
        lacking = []
        for target, spark_type in data_types.items():
            kind = arrow_type(spark_type)
            source = source_of.get(target)
            if target in key_values:
                columns[target] = key_values[target].cast(kind)
            elif source is not None:
                columns[target] = new_fields[source].take(last).cast(kind)
            else:  # a target column the source no longer has: the upsert keeps the target's value
                columns[target] = pa.nulls(len(last), kind)
                lacking.append(target)
    except _ARROW_FAILURES:
        return None
    upserts = pc.equal(final_op, "U")
    columns[OP] = final_op.cast(pa.string())
    no_keep = pa.scalar(None, pa.list_(pa.string()))
    columns[KEEP] = pc.if_else(upserts, pa.scalar(lacking, pa.list_(pa.string())) if lacking else no_keep, no_keep)
    columns[COMMIT_LSN] = table.column("commit_lsn").combine_chunks().take(last)
    columns[COMMIT_TS] = table.column("commit_ts").combine_chunks().take(last)
    lsns = table.column("commit_lsn")
    op_counts = Counter({str(entry["values"]): int(entry["counts"]) for entry in pc.value_counts(op).to_pylist()})
    any_upsert = bool(pc.any(upserts).as_py())
    return CollapsedColumns(columns, len(last), op_counts, lsns[0].as_py(), lsns[count - 1].as_py(), new_rows_only,
                            frozenset(lacking) if any_upsert else frozenset())


def _row_keys(table: pa.Table, op: pa.Array, new_fields: Mapping[str, pa.Array],
              sources: list[str]) -> list[pa.Array] | None:
    """Per change row, its key: the new image's for inserts and updates, the old (or key) image's
    for deletes. None when an update changes its key, or a key column cannot be grouped."""
    old = table.column("old").combine_chunks()
    key = table.column("key").combine_chunks()
    old_fields, key_fields = _fields(old), _fields(key)
    old_present, key_present = old.is_valid(), key.is_valid()
    deletes, updates = pc.equal(op, "D"), pc.equal(op, "U")
    rows = []
    for source in sources:
        new_value = new_fields[source]
        if pa.types.is_floating(new_value.type) or source not in key_fields:
            return None
        identity = pc.if_else(old_present, old_fields[source], pc.if_else(key_present, key_fields[source], new_value))
        same = pc.or_kleene(pc.equal(identity, new_value), pc.and_(pc.is_null(identity), pc.is_null(new_value)))
        if not pc.all(pc.or_(pc.invert(updates), pc.fill_null(same, False))).as_py():
            return None  # an update moved its row to another key: the row-by-row collapse deletes the old one
        rows.append(pc.if_else(deletes, identity, new_value))
    return rows


def _fields(image: pa.StructArray) -> dict[str, pa.Array]:
    """An image's columns by name, null where the image is absent."""
    return {field.name: values for field, values in zip(image.type, image.flatten())}
