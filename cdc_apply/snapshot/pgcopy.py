"""``format("pgcopy")``: one table's rows at an exported snapshot, read by Spark's tasks in parallel.

The initial copy's executor side (docs/live.md, "Initial copy on Spark's executors"). The driver plans the table's
page ranges (``ExportedSnapshot.page_ranges``) and hands them over with a ``TableCopy``; each
task opens its own connection, joins the exported snapshot, reads its ranges with
``COPY (SELECT ... WHERE ctid ...)``, splits each chunk into columns with Arrow's CSV reader
(``sources/copy_arrow.py``), converts them with the converters the stream's values take
(``changerows.columns.text_column``), and yields the chunk as one ``pyarrow.RecordBatch`` of the
target's columns: a task holds one chunk at a time, the driver none.

With ``files_root`` set, a task writes each range's batches into one Parquet file of the table's
directory itself (pyarrow, with the table's physical column names) and yields only the file's
path, size, rows and statistics: the driver commits them (``apply/targets.FileAppend``). Spark's Arrow
hand-over and the JVM's Parquet writer were about half of a copy's time (docs/live.md, "Initial
copy on Spark's executors"). With ``log`` set too (the change log is on), the task also writes the
range's rows, from the same COPY text, into one file of the change log (``changelog/log_files.CopyLog``),
which the driver commits before the target's.

A chunk the columnar conversion does not take (a value its target column cannot hold, a value
Arrow cannot represent) fails the task with ``NEEDS_DRIVER`` in its message: the driver then
copies the table its own way, which converts row by row, switches a column to text under
``evolve``, or names the value.
"""

from __future__ import annotations

import base64
import pickle
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from cdc_apply.arrow_nulls import null_array
from cdc_apply.apply.files import ParquetFile, new_file_name
from cdc_apply.changerows.codec import RelationCodec, UnrepresentableColumnError
from cdc_apply.changerows.columns import NotArrowRepresentable, text_column
from cdc_apply.errors import CdcApplyError
from cdc_apply.lake.location import FileRoot
from cdc_apply.pgtypes import TypeCache, portable_type_cache
from cdc_apply.pgtypes.sparktypes import arrow_type
from cdc_apply.sources.copy_arrow import copy_columns
from cdc_apply.sources.exported_snapshot import CopyData, CopyRange, PublishedTable, SnapshotLost, read_range
from cdc_apply.changelog.log_files import CopyLog
from cdc_apply.spark.rows import SPARK_DDL
from cdc_apply.spark.typed import quoted, spark_arrow

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

NEEDS_DRIVER = "cdc_apply: this copy needs the driver's conversion"
_ARROW_FAILURES = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)


@dataclass(frozen=True)
class TableCopy:
    """What every task of one table's copy needs, and nothing bigger: it is pickled into each task."""

    conninfo: str
    snapshot: str  # the exported snapshot's name
    table: PublishedTable
    column_map: Mapping[str, str | None]  # source column -> target column (None: not kept)
    data_types: Mapping[str, str]  # target column -> Spark type, in the target's order
    text_columns: frozenset[str] = frozenset()  # source columns converted as PostgreSQL's exact text
    custom_types: Mapping[int, tuple[str, str, str | None]] = field(default_factory=dict)  # TypeCache.named
    chunk_rows: int = 100_000
    # Columns every copied row holds the same value in (the metadata columns): name -> (Spark type, value)
    constants: Mapping[str, tuple[str, object]] = field(default_factory=dict)
    files_root: FileRoot | None = None  # the tasks write Parquet files here themselves (see the module's text)
    physical_columns: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)  # FileAppend's
    log: CopyLog | None = None  # with files_root: the tasks also write the rows into the change log
    log_rows: bool = False  # with log and no files_root: the tasks yield the change log's rows instead

    def columns(self) -> dict[str, str]:
        """Every column a chunk's batch holds, with its Spark type."""
        return {**self.data_types, **{name: kind for name, (kind, _) in self.constants.items()}}

    def type_cache(self) -> TypeCache:
        return portable_type_cache(self.text_columns, self.custom_types)


class CopyNeedsDriver(CdcApplyError):
    """A chunk the columnar conversion does not take; the driver copies the table row by row."""


def chunk_values(copy: TableCopy, chunk: CopyData) -> list[pa.Array]:
    """One COPY chunk as one array of PostgreSQL's text per source column (``copy_arrow``)."""
    relation = copy.table.relation
    if not relation.columns:
        raise CopyNeedsDriver(f"{NEEDS_DRIVER}: {copy.table.qualified_name} has no published column")
    return copy_columns(chunk.data, len(relation.columns), chunk.located)


def chunk_batch(copy: TableCopy, raw: list[pa.Array], chunk: CopyData, codec: RelationCodec) -> pa.RecordBatch:
    """One COPY chunk's values (``chunk_values``) as the target's columns: each source column converted
    by the converter the stream's values take (``changerows.columns.text_column``), then cast to its
    target column, as the columnar collapse casts a snapshot chunk on the driver (``apply/columnar.py``)."""
    try:
        values = {column.name: text_column(column_values, column, chunk.located)
                  for column, column_values in zip(codec.columns, raw, strict=True)}
        rows = len(raw[0])
        source_of = {target: source for source, target in copy.column_map.items() if target is not None}
        arrays = []
        for target, spark_type in copy.data_types.items():
            kind = spark_arrow(arrow_type(spark_type))
            source = source_of.get(target)
            arrays.append(null_array(rows, kind) if source is None else values[source].cast(kind))
        for spark_type, value in copy.constants.values():
            arrays.append(pa.repeat(pa.scalar(value, spark_arrow(arrow_type(spark_type))), rows))
    except (UnrepresentableColumnError, NotArrowRepresentable, *_ARROW_FAILURES) as exc:
        raise CopyNeedsDriver(f"{NEEDS_DRIVER}: {exc}") from None
    return pa.RecordBatch.from_arrays(arrays, names=list(copy.columns()))


# What a task that writes files yields: one row per file, ``changelog`` true for a file of the
# change log's (with ``copy.log``), false for the target's.
FILE_COLUMNS = "path STRING, size BIGINT, rows BIGINT, stats STRING, changelog BOOLEAN"
_FILE_SCHEMA = pa.schema([("path", pa.string()), ("size", pa.int64()), ("rows", pa.int64()), ("stats", pa.string()),
                          ("changelog", pa.bool_())])


def write_files(copy: TableCopy, pages: CopyRange, chunks: Iterable[CopyData], codec: RelationCodec,
                task: int) -> Iterator[pa.RecordBatch]:
    """A range's chunks in one new Parquet file under ``copy.files_root`` (``apply/files.py``) and, with
    ``copy.log``, their change log rows in one new file of the log (``changelog/log_files.py``); a row
    (``FILE_COLUMNS``) for each file that holds rows."""
    assert copy.files_root is not None
    target = ParquetFile(copy.files_root, new_file_name(task), copy.physical_columns)
    log = copy.log
    log_file = log.file(task) if log is not None else None
    try:
        for chunk in chunks:
            raw = chunk_values(copy, chunk)
            target.write(chunk_batch(copy, raw, chunk, codec))
            if log_file is not None:
                assert log is not None
                log_file.write(log.range_inserts(pages.source, pages.first_page, raw, len(raw[0]), chunk.first_row))
    finally:
        written = [(target.close(), False), (log_file.close() if log_file is not None else None, True)]
    for file, in_log in written:
        if file is not None:
            yield pa.RecordBatch.from_pydict({"path": [file.path], "size": [file.size], "rows": [file.rows],
                                              "stats": [file.stats], "changelog": [in_log]}, _FILE_SCHEMA)


class CopyPartition(InputPartition):
    def __init__(self, index: int, ranges: Sequence[CopyRange]) -> None:
        super().__init__(index)
        self.ranges = list(ranges)


class PgCopyDataSource(DataSource):
    """Options: ``copy`` (a pickled ``TableCopy``), ``ranges`` (pickled lists of ``CopyRange``, one per task)."""

    @classmethod
    def name(cls) -> str:
        return "pgcopy"

    def schema(self) -> str:
        copy = _unpickled(self.options["copy"])
        if copy.files_root is not None:
            return FILE_COLUMNS
        if copy.log_rows:
            return SPARK_DDL
        return ", ".join(f"{quoted(name)} {kind}" for name, kind in copy.columns().items())

    def reader(self, schema: object) -> DataSourceReader:
        return PgCopyReader(_unpickled(self.options["copy"]), _unpickled(self.options["ranges"]))


class PgCopyReader(DataSourceReader):
    def __init__(self, copy: TableCopy, tasks: list[list[CopyRange]]) -> None:
        self.copy = copy
        self.tasks = tasks

    def partitions(self) -> Sequence[InputPartition]:
        return [CopyPartition(i, ranges) for i, ranges in enumerate(self.tasks)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        copy = self.copy
        codec = RelationCodec.build(copy.table.relation, copy.type_cache())
        ranges: list[CopyRange] = partition.ranges  # type: ignore[attr-defined]
        # One line in the executor's log (its stderr): where each range of a copy was read.
        pages_read = ", ".join(f"{r.namespace}.{r.name}:{r.first_page}..{'' if r.end_page is None else r.end_page}"
                               for r in ranges)
        print(f"cdc_apply copy task {partition.value} of {copy.table.qualified_name}: {len(ranges)} range(s), "
              f"pages {pages_read}", file=sys.stderr, flush=True)
        for pages in ranges:
            chunks = read_range(copy.conninfo, copy.snapshot, copy.table, pages, copy.chunk_rows)
            if copy.log_rows:
                yield from _log_rows(copy, pages, chunks)
            elif copy.files_root is None:
                yield from (chunk_batch(copy, chunk_values(copy, chunk), chunk, codec) for chunk in chunks)
            else:
                yield from write_files(copy, pages, chunks, codec, partition.value)  # type: ignore[attr-defined]


def _log_rows(copy: TableCopy, pages: CopyRange, chunks: Iterable[CopyData]) -> Iterator[pa.RecordBatch]:
    """A range's rows as the change log's, every column of its layout (for Delta's writer)."""
    log = copy.log
    assert log is not None
    for chunk in chunks:
        raw = chunk_values(copy, chunk)
        yield log.rows_for_writer(log.range_inserts(pages.source, pages.first_page, raw, len(raw[0]), chunk.first_row))


def copy_frame(spark: SparkSession, copy: TableCopy, ranges: Sequence[CopyRange], tasks: int) -> DataFrame:
    """The ranges' rows as a DataFrame of the target's columns, read by ``tasks`` Spark tasks (each
    range whole in one task, spread round robin so that neighbouring ranges run at once); with
    ``copy.files_root``, the files the tasks wrote (``FILE_COLUMNS``); with ``copy.log_rows``, the
    change log's rows of them (read from PostgreSQL again: Delta's writer takes one frame a table)."""
    tasks = max(1, min(tasks, len(ranges)))
    spread = [list(ranges[i::tasks]) for i in range(tasks)]
    spark.dataSource.register(PgCopyDataSource)  # format("pgcopy")
    return (spark.read.format("pgcopy").option("copy", _pickled(copy)).option("ranges", _pickled(spread)).load())


_PYTHON_ERROR = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*): (.*)$", re.MULTILINE)


@contextmanager
def task_errors(table: str) -> Iterator[None]:
    """A Spark job over ``format("pgcopy")`` whose task raised: raised again on the driver as itself
    (``CopyNeedsDriver``, ``SnapshotLost``) or as a ``CdcApplyError`` with the task's own message
    (the last line of its Python traceback), never as Spark's wrapped traceback."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    try:
        yield
    except (PySparkException, Py4JJavaError) as exc:
        text = str(exc)
        _, traceback, raised = text.rpartition("Traceback (most recent call last):")
        found = _PYTHON_ERROR.search(raised) if traceback else None
        if found is None:
            raise
        kind, message = found[1], found[2].strip()
        if kind == "CopyNeedsDriver":
            raise CopyNeedsDriver(message) from None
        if kind == "SnapshotLost":
            raise SnapshotLost(message) from None
        raise CdcApplyError(f"the copy of {table} failed in a Spark task: {kind}: {message}") from None


def _pickled(value: object) -> str:
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def _unpickled(text: str):  # type: ignore[no-untyped-def]
    return pickle.loads(base64.b64decode(text))


__all__ = ["FILE_COLUMNS", "NEEDS_DRIVER", "CopyNeedsDriver", "PgCopyDataSource", "TableCopy", "chunk_batch",
           "chunk_values", "copy_frame", "task_errors", "write_files"]
