"""The type registry: PostgreSQL type OID -> Spark type + text and binary converters.

Each OID is registered once, by its family module, with its scalar converters and, where one
exists, the vector converters that turn a whole column at once (``pgtypes/vectorized.py``: the
contract they keep and the helpers they share). A vector converter gives exactly what the
scalar one gives, and the column path falls back to the scalar one on anything else.

A converter turns the raw bytes pgoutput sent for one value into the value cdc_apply carries to
Spark (see docs/types.md for each type's rule). Converters raise ``ValueConversionError`` for
bytes that are not a valid value of their type, and ``UnrepresentableValueError`` for valid
values the Spark type cannot hold; nothing is changed silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cdc_apply.errors import CdcApplyError

TextConverter = Callable[[str, int], Any]  # (text, typmod) -> value
BinaryConverter = Callable[[bytes, int], Any]  # (bytes, typmod) -> value
SparkTypeOf = Callable[[int], str]  # typmod -> Spark SQL type (DDL)
# (a column's raw values as an Arrow array, the column's Arrow type) -> Arrow array of that type
VectorConverter = Callable[[Any, Any], Any]


class ValueConversionError(CdcApplyError):
    pass


class UnrepresentableValueError(ValueConversionError):
    pass


@dataclass(frozen=True, slots=True)
class PgType:
    oid: int
    name: str
    spark_type: SparkTypeOf
    from_text: TextConverter
    from_binary: BinaryConverter
    to_json: Callable[[Any], Any] = lambda value: value
    array_oid: int | None = None
    vector_text: VectorConverter | None = None  # a column of text values at once (large_string)
    vector_binary: VectorConverter | None = None  # a column of binary values at once (large_binary)


_BY_OID: dict[int, PgType] = {}
_BY_NAME: dict[str, PgType] = {}


def register(pg_type: PgType) -> PgType:
    _BY_OID[pg_type.oid] = pg_type
    _BY_NAME[pg_type.name] = pg_type
    return pg_type


def fixed(spark: str) -> SparkTypeOf:
    return lambda typmod: spark


def lookup(oid: int) -> PgType | None:
    return _BY_OID.get(oid)


def lookup_name(name: str) -> PgType | None:
    return _BY_NAME.get(name)


def registered() -> list[PgType]:
    return list(_BY_OID.values())
