"""Read a Delta target back and render it as PostgreSQL text, to compare with the source table.

Spark values are turned back into cdc_apply's carried representation (microseconds, days, dicts)
in Spark itself, then rendered with the registry's ``to_json`` like the source rows' ``::text``.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

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


def delta_rows(spark: SparkSession, path: str, columns: list[str], types: dict[str, PgType],
               where: str | None = None) -> list[tuple[str | None, ...]]:
    frame = spark.read.format("delta").load(path)
    if where:
        frame = frame.where(where)
    fields = {f.name: f.dataType for f in frame.schema.fields}
    selected = frame.select([_carried(F.col(f"`{c}`"), fields[c]).alias(f"c{i}") for i, c in enumerate(columns)])
    rendered = []
    for row in selected.collect():
        values = []
        for i, name in enumerate(columns):
            value = _python(row[i])
            values.append(_as_text(None if value is None else types[name].to_json(value)))
        rendered.append(tuple(values))
    return sorted(rendered, key=repr)
