"""The change log's Parquet files (docs/change-log-table.md): how one is written, and an initial copy's rows
in the log's layout, which the copy's writers (Spark's tasks, or the driver) put in such files.

A copy (or resync) of a table writes its rows to the log as well as to the target, so that a rebuild
from the log alone holds them (``CopyLog``). Each row is an Insert (``op = 'I'``) at the copy's
version (its consistent point - 1, the version the target records), with ``xid`` 0: PostgreSQL never
gives a transaction xid 0, so a reader tells a copy's rows from streamed ones by it (the targets'
followers skip them: a copy writes its target itself). ``new`` and ``key`` are the row's text, as
COPY gave it; ``_cdc_change`` is the Insert message the row would have had from the slot
(``pgoutput.encode.encode_inserts``), ``_cdc_relation`` the Relation the copy read it under.

Each attempt at a copy starts with a Truncate row at its first ``seq``, its rows numbered after it:
a rebuild then drops what the table held before (its changes before the copy, an attempt cut short,
an earlier copy). An attempt's seqs start above those the log holds at the same version already
(a copy that fell back to the driver reuses its snapshot). Spark's tasks number a page range's rows
from the range's own first seq (``range_seqs``): a range of ``range_pages`` pages holds at most
``range_pages`` times the heap's line pointers per page of a snapshot's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from cdc_apply.arrow_nulls import null_array
from cdc_apply.apply.files import ParquetFile, WrittenFile, new_file_name
from cdc_apply.errors import CdcApplyError
from cdc_apply.lake.location import FileRoot
from cdc_apply.lsn import pg_us_to_unix_us
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.encode import encode_inserts, encode_relation
from cdc_apply.spark.rows import SOURCE_SCHEMA

# The Parquet column paths of the layout that get min/max statistics (those a read prunes by) and
# dictionary encoding (those whose values repeat). Writing every column's statistics, and trying a
# dictionary for every message and image value, took 30% longer for a file 6% larger.
STATISTICS_COLUMNS = ("commit_lsn", "commit_ts", "xid", "seq", "end_lsn")
DICTIONARY_COLUMNS = ("origin", "schema", "table", "op", "key.key_value.key", "old.key_value.key",
                      "new.key_value.key", "unchanged.list.element", "_cdc_relation")
COPY_XID = 0  # the xid of a copy's rows: no transaction
MAX_SEQ = 2**31 - 1  # seq is an int32 column


def log_file(root: str | FileRoot, relation_oid: int, task: int = 0) -> ParquetFile:
    """A new file of the table's partition directory under the log's ``root``, for batches of the
    layout's columns but ``relation_oid`` (the partition)."""
    return ParquetFile(root, f"relation_oid={relation_oid}/{new_file_name(task)}",
                       partition_values={"relation_oid": str(relation_oid)}, statistics=STATISTICS_COLUMNS,
                       dictionary=DICTIONARY_COLUMNS)


def write_log_file(root: str | FileRoot, relation_oid: int, batches: Iterable[pa.RecordBatch],
                   task: int = 0) -> WrittenFile | None:
    """``batches`` in one new ``log_file``; None when they hold no row."""
    return log_file(root, relation_oid, task).write_all(batches)


@dataclass(frozen=True)
class CopyLog:
    """What every writer of one attempt at a table's copy needs to put its rows in the log: small,
    it is pickled into each copy task."""

    root: FileRoot  # the change log's directory, and how to reach it
    relation: m.Relation
    version: int  # the copy's version: every row's commit_lsn and end_lsn
    commit_ts: int  # the copy's start, PostgreSQL microseconds
    first_seq: int  # the attempt's Truncate row; its rows come after it
    range_seqs: Mapping[tuple[int, int], int] = field(default_factory=dict)  # (source, first page) -> first seq
    range_slots: int = 0  # seqs per page range
    # The rows go in through Delta's writer (``rows_for_writer``), not as files: a session without
    # Delta's internal classes (Spark Connect), or a log by catalog name.
    by_writer: bool = False

    def range_inserts(self, source: int, first_page: int, values: Sequence[pa.Array], rows: int,
                      first_row: int) -> pa.RecordBatch:
        """``inserts`` of a page range's rows, ``first_row`` on, numbered within the range's own seqs."""
        first_seq = self.range_seqs[(source, first_page)]
        return self.inserts(values, rows, first_seq + first_row, first_seq + self.range_slots)

    def rows_for_writer(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` (the layout's columns but ``relation_oid``, the files' partition) with every column
        of the layout, for Delta's writer."""
        oid = pa.repeat(pa.scalar(self.relation.oid, SOURCE_SCHEMA.field("relation_oid").type), batch.num_rows)
        columns = dict(zip(batch.schema.names, batch.columns)) | {"relation_oid": oid}
        return pa.RecordBatch.from_arrays([columns[f.name] for f in SOURCE_SCHEMA], schema=SOURCE_SCHEMA)

    def truncate(self) -> pa.RecordBatch:
        """The attempt's first row: a Truncate of the table (no ``_cdc_change``, as the stream's)."""
        return self._batch(1, self.first_seq, "T", None, None, null_array(1, pa.binary()), truncate_options=0)

    def inserts(self, values: Sequence[pa.Array], rows: int, first_seq: int,
                seq_limit: int = MAX_SEQ + 1) -> pa.RecordBatch:
        """``rows`` rows of the copy as Inserts numbered from ``first_seq``: ``values`` one text array per
        column, in the relation's order, SQL NULL as null. ``seq_limit``: the first seq not theirs."""
        if first_seq + rows > seq_limit:
            raise CdcApplyError(f"{self.relation.namespace}.{self.relation.name}: the copy's change log rows would "
                                f"need seqs up to {first_seq + rows - 1}, past {seq_limit - 1}")
        names = [column.name for column in self.relation.columns]
        keys = [i for i, column in enumerate(self.relation.columns) if column.is_key]
        return self._batch(rows, first_seq, "I", text_map(names, values, rows),
                           text_map([names[i] for i in keys], [values[i] for i in keys], rows),
                           encode_inserts(self.relation.oid, values, rows))

    def write(self, batches: Iterable[pa.RecordBatch], task: int = 0) -> WrittenFile | None:
        return write_log_file(self.root, self.relation.oid, batches, task)

    def file(self, task: int) -> ParquetFile:
        return log_file(self.root, self.relation.oid, task)

    def _batch(self, rows: int, first_seq: int, op: str, new: pa.Array | None, key: pa.Array | None,
               messages: pa.Array, truncate_options: int | None = None) -> pa.RecordBatch:
        def repeat(value: object, kind: pa.DataType) -> pa.Array:
            return pa.repeat(pa.scalar(value, kind), rows)

        image = SOURCE_SCHEMA.field("new").type
        columns = {
            "commit_lsn": repeat(self.version, pa.int64()),
            "commit_ts": repeat(pg_us_to_unix_us(self.commit_ts), pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "xid": repeat(COPY_XID, pa.int64()),
            "seq": pa.array(np.arange(first_seq, first_seq + rows, dtype=np.int32)),
            "origin": null_array(rows, pa.string()),
            "schema": repeat(self.relation.namespace, pa.string()),
            "table": repeat(self.relation.name, pa.string()),
            "op": repeat(op, pa.string()),
            "key": null_array(rows, image) if key is None else key,
            "old": null_array(rows, image),
            "new": null_array(rows, image) if new is None else new,
            "unchanged": pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), pa.array([], pa.string())),
            "truncate_options": repeat(truncate_options, pa.int8()),
            "end_lsn": repeat(self.version, pa.int64()),
            "_cdc_relation": repeat(encode_relation(self.relation), pa.binary()),
            "_cdc_change": messages,
        }
        schema = pa.schema([f for f in SOURCE_SCHEMA if f.name != "relation_oid"])
        return pa.RecordBatch.from_arrays([columns[f.name].cast(f.type) for f in schema], schema=schema)


def text_map(names: Sequence[str], values: Sequence[pa.Array], rows: int) -> pa.Array:
    """Per row, a map of every column in ``names`` to its value in ``values`` (text; null for SQL NULL)."""
    count = len(names)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * count)
    if not count:  # a table without key columns: an empty key map per row, as the stream gives
        return pa.MapArray.from_arrays(offsets, pa.array([], pa.string()), pa.array([], pa.string()))
    stacked = pa.concat_arrays([column.cast(pa.large_binary()) for column in values])  # column after column
    row_major = (np.arange(rows)[:, None] + np.arange(count)[None, :] * rows).ravel()
    items = stacked.take(pa.array(row_major)).cast(pa.large_string()).cast(pa.string())
    keys = pa.array(list(names), pa.string()).take(pa.array(np.tile(np.arange(count), rows)))
    return pa.MapArray.from_arrays(offsets, keys, items)
