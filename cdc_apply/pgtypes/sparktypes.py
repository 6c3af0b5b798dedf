"""Spark SQL type strings (as the registry names them) -> Arrow types for the change rows."""

from __future__ import annotations

import re
from functools import lru_cache

import pyarrow as pa

_SIMPLE = {
    "boolean": pa.bool_(), "smallint": pa.int16(), "int": pa.int32(), "bigint": pa.int64(),
    "float": pa.float32(), "double": pa.float64(), "string": pa.string(), "binary": pa.binary(),
    "date": pa.date32(), "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ntz": pa.timestamp("us"),
}
_DECIMAL = re.compile(r"decimal\((\d+),(-?\d+)\)")


@lru_cache(maxsize=None)
def arrow_type(spark: str) -> pa.DataType:
    if spark in _SIMPLE:
        return _SIMPLE[spark]
    decimal = _DECIMAL.fullmatch(spark)
    if decimal:
        return pa.decimal128(int(decimal[1]), int(decimal[2]))
    if spark.startswith("array<") and spark.endswith(">"):
        return pa.list_(arrow_type(spark[6:-1]))
    if spark.startswith("struct<") and spark.endswith(">"):
        return pa.struct([pa.field(name, arrow_type(kind)) for name, kind in _struct_fields(spark[7:-1])])
    raise ValueError(f"no Arrow type for Spark type {spark!r}")


def _struct_fields(body: str) -> list[tuple[str, str]]:
    fields, depth, start = [], 0, 0
    for i, ch in enumerate(body + ","):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            name, _, kind = body[start:i].partition(":")
            fields.append((name, kind))
            start = i + 1
    return fields
