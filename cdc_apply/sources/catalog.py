"""What only the source's catalog knows, read when a live connection is at hand."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.errors import CdcApplyError
from cdc_apply.pgtypes import FIRST_RUNTIME_OID, TypeCache, lookup
from cdc_apply.pgtypes.user import UserType, facts_json

if TYPE_CHECKING:
    from cdc_apply.config import SourceConfig


@dataclass(frozen=True)
class MissingValue:
    """The value PostgreSQL gives rows that existed before ``ADD COLUMN ... DEFAULT`` (no WAL record).

    ``known`` is False when the catalog no longer holds it: a volatile default (the table was
    rewritten) or a later rewrite. ``text`` is the value's text form, None for NULL.
    """

    known: bool
    text: str | None
    has_default: bool
    generated: bool = False  # a stored generated column (PostgreSQL 18 publishes it on request)


class SourceCatalog:
    def __init__(self, conninfo: str, describe: str = "the source", unreachable_hint: str = "") -> None:
        """``describe``: the source as an error may name it (no secret); ``unreachable_hint``: what to
        do when the source cannot be reached for a lookup."""
        self.conninfo = conninfo
        self.describe = describe
        self.unreachable_hint = unreachable_hint

    @classmethod
    def of(cls, source: SourceConfig, unreachable_hint: str = "") -> SourceCatalog:
        return cls(source.conninfo(), source.describe(), unreachable_hint)

    def missing_value(self, relation_oid: int, column: str) -> MissingValue:
        """The value of ``column`` in rows older than its ``ADD COLUMN ... DEFAULT`` (a
        ``BatchApplier``'s ``missing_value`` lookup)."""
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT atthasmissing, (SELECT v FROM unnest(attmissingval::text::text[]) v), atthasdef, "
                    "attgenerated <> '' "
                    "FROM pg_attribute WHERE attrelid = %s AND attname = %s AND NOT attisdropped",
                    (relation_oid, column)).fetchone()
        except psycopg.OperationalError as exc:
            hint = f"; {self.unreachable_hint}" if self.unreachable_hint else ""
            raise CdcApplyError(f"the ADD COLUMN ... DEFAULT backfill of column {column!r} needs the source "
                                f"({self.describe}): {' '.join(str(exc).split())}{hint}") from None
        if row is None:
            return MissingValue(False, None, False)
        return MissingValue(bool(row[0]), row[1], bool(row[2]), bool(row[3]))

    def type_facts(self, type_oid: int) -> str | None:
        """The facts binary mode needs about a user-defined type and every user-defined type it is made
        of (a domain's base, a composite's fields, an array's element), as ``pgtypes.user.facts_json``;
        None if the catalog no longer holds the type."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            return read_type_facts(conn, type_oid)


def read_type_facts(conn: psycopg.Connection, type_oid: int) -> str | None:
    found: dict[int, UserType] = {}
    pending = [type_oid]
    while pending:
        oid = pending.pop()
        if oid in found or (oid != type_oid and (oid == 0 or lookup(oid) is not None)):
            continue  # built-in types need no facts
        row = conn.execute(
            "SELECT n.nspname, t.typname, t.typtype, t.typbasetype, t.typelem, t.typlen, t.typrelid "
            "FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace WHERE t.oid = %s", (oid,)).fetchone()
        if row is None:
            if oid == type_oid:
                return None
            continue
        namespace, name, typtype, base, element, length, relid = row
        qualified = f"{namespace}.{name}"
        if typtype == "d":
            user = UserType(oid, qualified, "domain", base=base)
        elif typtype == "e":
            user = UserType(oid, qualified, "enum")
        elif typtype == "c":
            fields = conn.execute("SELECT attname, atttypid FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
                                  "AND NOT attisdropped ORDER BY attnum", (relid,)).fetchall()
            user = UserType(oid, qualified, "composite", fields=tuple((n, t) for n, t in fields))
        elif element and length == -1:
            user = UserType(oid, qualified, "array", base=element)
        else:
            user = UserType(oid, qualified, "other")
        found[oid] = user
        pending.extend([user.base, *(t for _, t in user.fields)])
    return facts_json(found.values())


_BASE_TYPE_QUERY = """
WITH RECURSIVE chain(oid, typ, depth) AS (
    SELECT t.oid, t.oid, 0 FROM pg_type t WHERE t.oid = ANY(%s)
    UNION ALL
    SELECT chain.oid, t.typbasetype, chain.depth + 1 FROM chain JOIN pg_type t ON t.oid = chain.typ
    WHERE t.typtype = 'd' AND chain.depth < 64
)
SELECT DISTINCT ON (chain.oid) chain.oid, CASE WHEN n.nspname = 'pg_catalog' THEN '' ELSE n.nspname END, b.typname
FROM chain JOIN pg_type b ON b.oid = chain.typ JOIN pg_namespace n ON n.oid = b.typnamespace
ORDER BY chain.oid, chain.depth DESC
"""


def type_messages(conn: psycopg.Connection, type_oids: Iterable[int]) -> list[tuple[int, str, str, str | None]]:
    """The Type messages pgoutput sends before a Relation whose columns have ``type_oids``, as
    ``(oid, namespace, name, facts)``: one per type made at run time, named as pgoutput names it (its
    base type's namespace and name, a domain's base at any depth; ``''`` for ``pg_catalog``), with
    the catalog's facts. A copy registers these in the type cache the stream's Type messages fill,
    so a column gets one type whichever path writes its first value."""
    wanted = sorted({oid for oid in type_oids if oid >= FIRST_RUNTIME_OID})
    if not wanted:
        return []
    named = conn.execute(_BASE_TYPE_QUERY, (wanted,)).fetchall()
    return [(oid, namespace, name, read_type_facts(conn, oid)) for oid, namespace, name in named]


def register_column_types(conn: psycopg.Connection, types: TypeCache, type_oids: Iterable[int]) -> None:
    """``type_messages`` added to ``types``, as the stream's Type messages add them."""
    for oid, namespace, name, facts in type_messages(conn, type_oids):
        types.add(oid, namespace, name, facts)
