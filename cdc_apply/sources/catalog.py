"""What only the source's catalog knows, read when a live connection is at hand."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg


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
    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo

    def missing_value(self, relation_oid: int, column: str) -> MissingValue:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT atthasmissing, (SELECT v FROM unnest(attmissingval::text::text[]) v), atthasdef, "
                "attgenerated <> '' "
                "FROM pg_attribute WHERE attrelid = %s AND attname = %s AND NOT attisdropped",
                (relation_oid, column)).fetchone()
        if row is None:
            return MissingValue(False, None, False)
        return MissingValue(bool(row[0]), row[1], bool(row[2]), bool(row[3]))
