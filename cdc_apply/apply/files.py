"""Parquet files written outside Delta's writer, and the statistics Delta keeps of them.

Two writers use it: the initial copy's Spark tasks (``snapshot/pgcopy.py``) and the change log's
append on the driver (``changelog/log.py``). Both write with pyarrow into the table's directory and
hand the files to a ``targets.FileAppend``, which makes them part of the table in one commit.
Spark's Arrow hand-over and the JVM's Parquet writer cost about as much again as producing the
rows (docs/live.md, "Who writes the files"; docs/change-log-table.md, "Who writes the files").
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_apply.lake.location import FileRoot


@dataclass(frozen=True)
class WrittenFile:
    """A Parquet file written into a table's directory: not part of the table until a
    ``FileAppend`` commits it."""

    path: str  # relative to the table's root
    size: int
    rows: int
    stats: str  # Delta's statistics JSON (numRecords, and min/max values where the writer knows them exactly)
    partition_values: Mapping[str, str] = field(default_factory=dict)


def new_file_name(task: int) -> str:
    """A data file's name, as Spark names its own."""
    return f"part-{task:05d}-{uuid.uuid4()}-c000.snappy.parquet"


def write_parquet_file(root: str | FileRoot, path: str, batches: Iterable[pa.RecordBatch],
                       physical_columns: Mapping[str, tuple[str, int | None]] | None = None,
                       partition_values: Mapping[str, str] | None = None,
                       statistics: Sequence[str] | None = None,
                       dictionary: Sequence[str] | None = None) -> WrittenFile | None:
    """``batches`` in one new snappy Parquet file (``ParquetFile``); None when there were no rows."""
    return ParquetFile(root, path, physical_columns, partition_values, statistics, dictionary).write_all(batches)


class ParquetFile:
    """One new snappy Parquet file at ``path`` under the table's ``root`` (a local directory, or one on an
    object store with the storage to reach it: ``FileRoot``), written a batch at a time,
    each column under its physical name and field id (column mapping: ``physical_columns``); no
    file is left when no batch had rows. ``statistics`` and ``dictionary``: the Parquet column paths
    that get min/max statistics and dictionary encoding (None: every column)."""

    def __init__(self, root: str | FileRoot, path: str,
                 physical_columns: Mapping[str, tuple[str, int | None]] | None = None,
                 partition_values: Mapping[str, str] | None = None, statistics: Sequence[str] | None = None,
                 dictionary: Sequence[str] | None = None) -> None:
        self.path = path
        self.root = FileRoot.of(root)
        self._filesystem, self.full_path = self.root.file(path)
        self.physical_columns = physical_columns or {}
        self.partition_values = dict(partition_values or {})
        self.statistics = statistics
        self.dictionary = dictionary
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            if self.root.location.local:
                os.makedirs(os.path.dirname(self.full_path), exist_ok=True)
            schema = pa.schema([_physical_field(self.physical_columns, f) for f in batch.schema])
            self._writer = pq.ParquetWriter(
                self.full_path, schema, filesystem=self._filesystem, compression="snappy",
                write_statistics=True if self.statistics is None else list(self.statistics),
                use_dictionary=True if self.dictionary is None else list(self.dictionary))
        self._writer.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=self._writer.schema))
        self.rows += batch.num_rows

    def write_all(self, batches: Iterable[pa.RecordBatch]) -> WrittenFile | None:
        """Each of ``batches``, then the file closed (``close``)."""
        try:
            for batch in batches:
                self.write(batch)
        finally:
            written = self.close()
        return written

    def close(self) -> WrittenFile | None:
        """The file written; None when nothing was."""
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        size = self._filesystem.get_file_info(self.full_path).size
        with self._filesystem.open_input_file(self.full_path) as written:
            statistics = file_statistics(written, self.rows)
        return WrittenFile(self.path, size, self.rows, statistics, self.partition_values)


def _physical_field(physical_columns: Mapping[str, tuple[str, int | None]], column: pa.Field) -> pa.Field:
    name, field_id = physical_columns.get(column.name, (column.name, None))
    return pa.field(name, column.type, metadata=None if field_id is None else {b"PARQUET:field_id": str(field_id)})


_EPOCH = datetime.date(1970, 1, 1)
_PYTHON_DAYS = ((datetime.date.min - _EPOCH).days, (datetime.date.max - _EPOCH).days)


def file_statistics(path: str | pa.NativeFile, rows: int) -> str:
    """Delta's statistics of a written file (by physical column name): its row count, and the null
    counts and exact min/max values of its integer and date columns, from the Parquet footer. Other
    columns have none, and a reader skips no file by them: Delta's own writer truncates strings and
    timestamps in ways these would have to match exactly, or a reader would skip files it must read."""
    footer = pq.read_metadata(path)
    if not footer.num_row_groups:
        return json.dumps({"numRecords": rows})
    types = {field.name: field.type for field in footer.schema.to_arrow_schema()}
    minimum: dict[str, object] = {}
    maximum: dict[str, object] = {}
    nulls: dict[str, int] = {}
    for index in range(footer.num_columns):
        name = footer.row_group(0).column(index).path_in_schema
        kind = types.get(name)  # None for a nested column's leaves
        if kind is None or not (pa.types.is_signed_integer(kind) or pa.types.is_date32(kind)):
            continue
        groups = [footer.row_group(group).column(index).statistics for group in range(footer.num_row_groups)]
        if any(stats is None or not stats.has_null_count for stats in groups):
            continue
        nulls[name] = sum(stats.null_count for stats in groups)
        bounded = [stats for stats in groups if stats.has_min_max]
        if not bounded:
            continue
        # The raw values: days since 1970 for a date, which may lie outside Python's years 1 to 9999.
        low, high = min(stats.min_raw for stats in bounded), max(stats.max_raw for stats in bounded)
        if pa.types.is_date32(kind):
            if not _PYTHON_DAYS[0] <= low <= high <= _PYTHON_DAYS[1]:
                continue
            low, high = (str(_EPOCH + datetime.timedelta(days=days)) for days in (low, high))  # yyyy-mm-dd
        minimum[name], maximum[name] = low, high
    return json.dumps({"numRecords": rows, "minValues": minimum, "maxValues": maximum, "nullCount": nulls,
                       "tightBounds": True})
