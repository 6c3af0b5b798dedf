"""Read a Delta target back and render it as PostgreSQL text, to compare with the source table.

Spark values are turned back into cdc_apply's carried representation (microseconds, days, dicts)
in Spark itself, then rendered with the registry's ``to_json`` like the source rows' ``::text``.

Every read is made twice: by Spark and by delta-rs (the ``deltalake`` package, which Polars and
DuckDB users read with), and the two must agree. delta-rs is left out only for a table that
requires a feature it cannot read (``DELTA_RS_UNREADABLE``); ``delta_rs_left_out`` records which.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_apply.lake.location import Location, Storage
from cdc_apply.pgtypes import PgType, TypeCache
from tests.reference_apply import _as_text


def _carried(column: Column, kind: T.DataType) -> Column:
    if isinstance(kind, T.TimestampType):
        return F.unix_micros(column)
    if isinstance(kind, T.TimestampNTZType):
        return F.unix_micros(column.cast("timestamp"))
    if isinstance(kind, T.DateType):
        return F.unix_date(column)
    if isinstance(kind, T.ArrayType):
        return F.transform(column, lambda element: _carried(element, kind.elementType))
    return column


def _python(value: Any) -> Any:
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, list):
        return [_python(v) for v in value]
    if hasattr(value, "asDict"):
        return {k: _python(v) for k, v in value.asDict().items()}
    return value


def source_types(conn: Any, qualified: str) -> dict[str, PgType]:
    schema, _, table = qualified.partition(".")
    rows = conn.execute(
        "SELECT a.attname, a.atttypid, t.typname, n.nspname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "JOIN pg_namespace n ON n.oid = t.typnamespace WHERE a.attrelid = format('%%I.%%I', %s::text, %s::text)::regclass "
        "AND a.attnum > 0 AND NOT a.attisdropped", (schema, table)).fetchall()
    cache = TypeCache()
    types = {}
    for name, oid, typname, namespace in rows:
        pg_type = cache.get(oid)
        if pg_type.name.startswith("oid "):
            pg_type = cache.add(oid, namespace, typname)
        types[name] = pg_type
    return types


# Table features delta-rs 1.6.6 refuses to read (its error: "Unsupported table features required").
DELTA_RS_UNREADABLE = {"typeWidening"}
delta_rs_left_out: dict[str, set[str]] = {}
delta_rs_reads = [0]  # reads compared with Spark's, for the session summary (conftest.py)


def parquet_writers(path: str) -> set[str]:
    """Who wrote the table's Parquet files (``created_by`` without its version): ``parquet-mr`` for
    Delta's writer, ``parquet-cpp-arrow`` for the copy's tasks and the change log's driver (``apply/files.py``)."""
    import pyarrow.parquet as pq

    return {pq.ParquetFile(file).metadata.created_by.split(" version")[0] for file in Path(path).rglob("*.parquet")
            if "_delta_log" not in file.parts}


def log_actions(path: str) -> Iterator[dict[str, Any]]:
    """Every action of the table's JSON log, oldest first."""
    for entry in sorted(Path(path, "_delta_log").glob("*.json")):
        for line in entry.read_text().splitlines():
            yield json.loads(line)


def reader_features(path: str) -> set[str]:
    """The reader features of the table's newest protocol action, from its JSON log."""
    features: set[str] = set()
    for action in log_actions(path):
        if "protocol" in action:
            features = set(action["protocol"].get("readerFeatures") or [])
    return features


def file_statistics(path: str) -> list[dict[str, Any]]:
    """The statistics of every file a commit of the table's JSON log added."""
    return [json.loads(action["add"]["stats"]) for action in log_actions(path)
            if "add" in action and action["add"].get("stats")]


def _arrow_carried(array: pa.Array) -> pa.Array:
    """delta-rs's Arrow values -> the carried representation that _carried gives on the Spark side."""
    kind = array.type
    if pa.types.is_timestamp(kind):
        return pc.cast(array.cast(pa.timestamp("us", kind.tz)), pa.int64())
    if pa.types.is_date32(kind):
        return pc.cast(array, pa.int32())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        values = _arrow_carried(array.flatten())
        return pa.ListArray.from_arrays(array.offsets, values, mask=array.is_null())
    if pa.types.is_struct(kind):
        fields = [_arrow_carried(array.field(i)) for i in range(kind.num_fields)]
        return pa.StructArray.from_arrays(fields, names=[f.name for f in kind], mask=array.is_null())
    return array


def _rendered(values: list[list[Any]], columns: list[str], types: dict[str, PgType]) -> list[tuple[str | None, ...]]:
    rendered = []
    for row in values:
        rendered.append(tuple(_as_text(None if value is None else types[name].to_json(_python(value)))
                              for name, value in zip(columns, row, strict=True)))
    return sorted(rendered, key=repr)


def delta_rs_rows(path: str, columns: list[str], types: dict[str, PgType],
                  where: str | None = None, storage: Storage | None = None) -> list[tuple[str | None, ...]] | None:
    """The table read by delta-rs, or None when it requires a feature delta-rs cannot read.
    ``storage``: how to reach an object store (its endpoint and keys), for a path there."""
    if storage is not None and not Location.parse(path).local:
        location = Location.parse(path)
        delta_rs_reads[0] += 1
        table = pa.RecordBatchReader.from_stream(DeltaTable(
            storage.delta_rs_uri(location), storage_options=storage.delta_rs_options(location)).scan(
                columns=columns, predicate=where)).read_all()
        return _delta_rs_rendered(table, columns, types)
    unreadable = reader_features(path) & DELTA_RS_UNREADABLE
    if unreadable:
        delta_rs_left_out[path] = unreadable
        warnings.warn(f"{path}: not read by delta-rs, which cannot read table feature(s) {sorted(unreadable)}",
                      stacklevel=3)
        return None
    delta_rs_reads[0] += 1
    table = pa.RecordBatchReader.from_stream(DeltaTable(path).scan(columns=columns, predicate=where)).read_all()
    return _delta_rs_rendered(table, columns, types)


def _delta_rs_rendered(table: pa.Table, columns: list[str], types: dict[str, PgType]) -> list[tuple[str | None, ...]]:
    if table.num_rows == 0:
        return []
    table = table.combine_chunks()
    carried = [_arrow_carried(table.column(name).combine_chunks()).to_pylist() for name in columns]
    return _rendered([list(row) for row in zip(*carried, strict=True)], columns, types)


def delta_rows(spark: SparkSession, path: str, columns: list[str], types: dict[str, PgType],
               where: str | None = None, storage: Storage | None = None) -> list[tuple[str | None, ...]]:
    """The table read by Spark; delta-rs must read the same rows wherever it can read the table."""
    rows = spark_rows(spark, path, columns, types, where)
    by_delta_rs = delta_rs_rows(path, columns, types, where, storage)
    if by_delta_rs is not None:
        assert by_delta_rs == rows, (f"{path}: delta-rs reads other rows than Spark: only Spark "
                                     f"{[r for r in rows if r not in by_delta_rs][:2]}, only delta-rs "
                                     f"{[r for r in by_delta_rs if r not in rows][:2]}")
    return rows


def spark_rows(spark: SparkSession, path: str, columns: list[str], types: dict[str, PgType],
               where: str | None = None, by_name: bool = False) -> list[tuple[str | None, ...]]:
    """``by_name``: ``path`` is a catalog table's name."""
    frame = spark.read.table(path) if by_name else spark.read.format("delta").load(path)
    if where:
        frame = frame.where(where)
    fields = {f.name: f.dataType for f in frame.schema.fields}
    selected = frame.select([_carried(F.col("`" + c.replace("`", "``") + "`"), fields[c]).alias(f"c{i}")
                             for i, c in enumerate(columns)])
    return _rendered([list(row) for row in selected.collect()], columns, types)
