"""A batch of new rows only, from the Arrow change rows straight to the append's source.

When the collapse would change nothing, it is skipped and no value becomes a Python object: every
change of the table in the batch is an insert, under one Relation definition, and each insert is a
row of its own (its key is unique in the batch, or the table has no key). ``BatchApplier`` uses
this only where it would append the collapsed rows anyway (a target this pipeline alone has
written, and a unique source key), so both paths write the same rows
(tests/test_type_delta.py holds them equal for every type).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS
from cdc_apply.changerows.columns import NotArrowRepresentable
from cdc_apply.changerows.segments import TableChanges
from cdc_apply.pgtypes.sparktypes import arrow_type


@dataclass(frozen=True)
class InsertedRows:
    columns: dict[str, pa.Array]  # target column -> values, and the commit LSN and timestamp
    count: int
    first_lsn: int
    last_lsn: int


def inserted_rows(segment: TableChanges, after_lsn: int | None, column_map: Mapping[str, str | None],
                  keys: tuple[str, ...], data_types: Mapping[str, str]) -> InsertedRows | None:
    """The segment's inserts after ``after_lsn`` as target columns, or None when they need the collapse
    (another operation, a key repeated in the batch, a value Arrow cannot cast) or there are none."""
    if not segment.from_stream or any(change.op != "I" for change in segment.changes):
        return None
    try:
        table = segment.to_arrow()
    except NotArrowRepresentable:
        return None
    if after_lsn is not None:
        table = table.filter(pc.greater(table["commit_lsn"], pa.scalar(after_lsn, pa.int64())))
    count = table.num_rows
    if count == 0:
        return None
    new = table.column("new").combine_chunks()
    columns: dict[str, pa.Array] = {}
    try:
        for source, target in column_map.items():
            if target is not None:
                columns[target] = new.field(source).cast(arrow_type(data_types[target]))
        for target, spark_type in data_types.items():
            if target not in columns:  # a target column the source no longer has
                columns[target] = pa.nulls(count, arrow_type(spark_type))
        if keys and pa.table({k: columns[k] for k in keys}).group_by(list(keys)).aggregate([]).num_rows != count:
            return None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError):
        return None
    lsns = table.column("commit_lsn").combine_chunks()
    columns[COMMIT_LSN] = lsns
    columns[COMMIT_TS] = table.column("commit_ts").combine_chunks()
    return InsertedRows(columns, count, lsns[0].as_py(), lsns[count - 1].as_py())
