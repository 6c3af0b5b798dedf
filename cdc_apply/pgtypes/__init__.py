"""PostgreSQL type OID -> Spark type and value conversion, for built-ins and Type-message types.

Usage: ``TypeCache().for_column(schema, table, column, oid)`` gives the column's ``PgType``: its
``spark_type(typmod)``, ``from_text(text, typmod)`` and ``from_binary(raw, typmod)``. Types named
only by a Type message (enums, domains, ...) are added with ``TypeCache.add``, with the catalog's
facts about them where known (``pgtypes/user.py``), which binary mode needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from cdc_apply.pgtypes import datetime as _datetime  # noqa: F401 - registers its types
from cdc_apply.pgtypes import network as _network  # noqa: F401
from cdc_apply.pgtypes import numbers as _numbers  # noqa: F401
from cdc_apply.pgtypes import system as _system  # noqa: F401
from cdc_apply.pgtypes import text as _text  # noqa: F401
from cdc_apply.pgtypes.arrays import array_type, register_array_types
from cdc_apply.pgtypes.ranges import register_range_types
from cdc_apply.pgtypes.registry import (
    PgType, UnrepresentableValueError, ValueConversionError, lookup, lookup_name, registered,
)
from cdc_apply.pgtypes.system import undecoded_builtin
from cdc_apply.pgtypes.exact_text import exact_text_type
from cdc_apply.pgtypes.user import parse_facts, user_type, wire_described_type

register_range_types()
register_array_types()


ColumnTypeOverride = Callable[[str, str, str], "str | None"]  # (schema, table, column) -> "string" or None


class TypeCache:
    """Built-in types plus the custom types this stream's Type messages named, and the columns the
    config maps to another type (``column_types``: schema, table, column -> ``"string"`` or None)."""

    def __init__(self, column_types: ColumnTypeOverride | None = None) -> None:
        self.custom: dict[int, PgType] = {}
        # what ``add`` was given, (namespace, name, facts): a copy of the cache in another process
        self.named: dict[int, tuple[str, str, str | None]] = {}
        self.column_types = column_types

    def for_column(self, namespace: str, table: str, name: str, type_oid: int) -> PgType:
        """The type a column's values are converted with: its own, or PostgreSQL's exact text."""
        pg_type = self.get(type_oid)
        if self.column_types is not None and self.column_types(namespace, table, name) == "string":
            return exact_text_type(pg_type)
        return pg_type

    def add(self, oid: int, namespace: str, name: str, facts: str | None = None) -> PgType:
        """``facts``: the catalog's facts about the type (``pgtypes.user.facts_json``), None when not known
        (a capture recorded without them): then only an enum's binary value can be read."""
        qualified = f"{namespace}.{name}" if namespace else name
        self.named[oid] = (namespace, name, facts)
        known = None if facts is None else user_type(oid, qualified, parse_facts(facts))
        base = lookup_name(name) if not namespace else None
        if known is not None:
            pg_type = known
        elif base is not None:
            # pgoutput names a domain by its base type: one over a built-in type reads as the base's text
            # in binary mode with no catalog facts (a capture made by another tool)
            pg_type = dataclasses.replace(exact_text_type(base), oid=oid, name=qualified)
        elif name.startswith("_"):  # PostgreSQL names an array type after its element with a '_'
            pg_type = array_type(oid, wire_described_type(0, f"{namespace}.{name[1:]}"))
        else:
            pg_type = wire_described_type(oid, qualified)
        self.custom[oid] = pg_type
        return pg_type

    def get(self, oid: int) -> PgType:
        pg_type = self.custom.get(oid) or lookup(oid)
        if pg_type is None and oid < FIRST_RUNTIME_OID:
            pg_type = undecoded_builtin(oid)
        elif pg_type is None:
            # A type made at run time without a Type message (none precedes a Relation in a capture cut
            # short): its text form.
            pg_type = wire_described_type(oid, f"oid {oid}")
        return pg_type


# pgoutput sends a Type message for a column type at or past this OID (PostgreSQL's FirstGenbkiObjectId):
# the types a server makes at run time, never those of the bootstrap catalog.
FIRST_RUNTIME_OID = 10000


def portable_type_cache(text_columns: frozenset[str],
                        custom_types: Mapping[int, tuple[str, str, str | None]]) -> TypeCache:
    """A copy of one table's type cache in a Spark task (a cache holds converters that do not pickle):
    the columns converted as PostgreSQL's exact text, and the custom types (``TypeCache.named``)."""
    types = TypeCache(column_types=lambda _schema, _table, name: "string" if name in text_columns else None)
    for oid, (namespace, name, facts) in custom_types.items():
        types.add(oid, namespace, name, facts)
    return types


__all__ = ["FIRST_RUNTIME_OID", "PgType", "TypeCache", "UnrepresentableValueError", "ValueConversionError", "lookup",
           "portable_type_cache", "registered"]
