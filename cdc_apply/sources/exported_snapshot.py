"""Reading tables at an exported snapshot: the source side of the initial snapshot.

``ExportedSnapshot`` creates a temporary pgoutput slot over a replication connection with
``SNAPSHOT 'export'``; while it is open, any session can ``SET TRANSACTION SNAPSHOT`` to see the
database exactly as of the slot's consistent point: every transaction committing before that
LSN is visible, none committing at or after it is.

``published_tables`` describes each published table as the Relation message pgoutput would send
(same columns, type OIDs, typmods and key flags), so the rows copied here and the changes
streamed later are judged against one schema.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import psycopg
from psycopg import sql

from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.sources.copy_text import CopyRows, parse_copy_text

KEY_FLAG = 1


@dataclass(frozen=True)
class PublishedTable:
    relation: m.Relation
    row_filter: str | None  # the publication's WHERE clause (PostgreSQL 15+), applied to the copy too
    partitioned: bool = False  # a partition root (publish_via_partition_root): read with its partitions

    @property
    def qualified_name(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"


class SnapshotLost(CdcApplyError):
    """The exported snapshot ended before a copy finished (its connection went away)."""


class ExportedSnapshot:
    def __init__(self, conninfo: str, slot_prefix: str = "cdc_apply_snapshot") -> None:
        self.slot = f"{slot_prefix}_{os.getpid()}"
        self.conninfo = conninfo
        self.conn: psycopg.Connection | None = None
        self.consistent_lsn = 0
        self.name = ""

    def __enter__(self) -> ExportedSnapshot:
        self.conn = psycopg.connect(self.conninfo, autocommit=True, replication="database")
        try:
            row = self.conn.execute(f'CREATE_REPLICATION_SLOT "{self.slot}" TEMPORARY LOGICAL pgoutput '
                                    "(SNAPSHOT 'export')").fetchone()
        except psycopg.Error as exc:
            self.conn.close()
            raise CdcApplyError(f"cannot export a snapshot (temporary slot {self.slot}): {exc}") from None
        assert row is not None
        _, lsn, self.name, _ = row
        self.consistent_lsn = parse_lsn(lsn)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.conn is not None:
            self.conn.close()  # a temporary slot goes with its connection

    def rows(self, table: PublishedTable, chunk_rows: int, order_by: Sequence[str] = (),
             after: Sequence[str] | None = None) -> Iterator[CopyRows]:
        """The table's rows at the snapshot, as COPY text values in UTF-8 (``copy_text.py``),
        ``chunk_rows`` at a time; ordered by the unique key ``order_by`` and, when ``after`` (its
        text values) is given, only the rows past it: the rest of a copy cut short."""
        relation = table.relation
        source = sql.SQL("{}{}").format(sql.SQL("" if table.partitioned else "ONLY "),
                                        sql.Identifier(relation.namespace, relation.name))
        with self._inside(f"{table.qualified_name} was copied") as conn:
            conditions: list[sql.Composable] = []
            if after is not None:
                kinds = [conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                                      "WHERE attrelid = %s AND attname = %s", (relation.oid, name)).fetchone()[0]
                         for name in order_by]
                conditions.append(sql.SQL("({}) > ({})").format(
                    sql.SQL(", ").join(map(sql.Identifier, order_by)),
                    sql.SQL(", ").join(sql.SQL("CAST({} AS {})").format(sql.Literal(value), sql.SQL(kind))
                                       for value, kind in zip(after, kinds, strict=True))))
            width = len(relation.columns)
            for chunk in _copy_chunks(conn, table, source, conditions, order_by, chunk_rows,
                                      f"COPY of {table.qualified_name}"):
                yield parse_copy_text(chunk.data, width, chunk.located)

    def storage(self, table: PublishedTable) -> tuple[list[int], int]:
        """The OIDs of the relations that store the table's rows at the snapshot (``copy_sources``),
        and their heap pages in all."""
        with self._inside(f"{table.qualified_name} was planned") as conn:
            oids = [oid for oid, _, _ in copy_sources(conn, table)]
            pages = conn.execute("SELECT coalesce(sum(pg_relation_size(oid)), 0)::bigint / "
                                 "current_setting('block_size')::int FROM unnest(%s::oid[]) oid", (oids,)).fetchone()[0]
            return oids, int(pages)

    def tuples_per_page(self) -> int:
        """The most tuples one heap page holds (PostgreSQL's MaxHeapTuplesPerPage): the page header's
        24 bytes off the block, then 4 bytes of line pointer and a 24-byte tuple header per tuple."""
        with self._inside("the block size was read") as conn:
            return (int(conn.execute("SELECT current_setting('block_size')").fetchone()[0]) - 24) // 28

    def page_ranges(self, table: PublishedTable, range_pages: int,
                    after: tuple[int, int | None] | None = None) -> tuple[list[int], list[CopyRange]]:
        """The table's heap split into ranges of ``range_pages`` pages, each copied on its own
        (``read_range``): per storage relation (the table, or each leaf partition of a partition
        root, ``copy_sources``), in page order, the last range of each open-ended (a relation's
        size is read after the export, when it can only have grown). Returns the storage relations'
        OIDs and the ranges; ``after`` (a storage relation's index and the page a copy cut short
        ended at, None when it finished that relation) leaves out what was copied."""
        with self._inside(f"{table.qualified_name} was planned") as conn:
            sources = copy_sources(conn, table)
            block = int(conn.execute("SELECT current_setting('block_size')").fetchone()[0])
            ranges = []
            for index, (oid, namespace, name) in enumerate(sources):
                first = 0
                if after is not None:
                    if index < after[0] or (index == after[0] and after[1] is None):
                        continue
                    first = after[1] if index == after[0] else 0  # type: ignore[assignment]
                pages = int(conn.execute("SELECT pg_relation_size(%s)", (oid,)).fetchone()[0]) // block
                starts = list(range(first, max(pages, first + 1), range_pages))
                ranges += [CopyRange(index, namespace, name, start, None if i == len(starts) - 1 else start + range_pages)
                           for i, start in enumerate(starts)]
            return [oid for oid, _, _ in sources], ranges

    def published_tables(self, publications: Sequence[str]) -> list[PublishedTable]:
        """The publications' tables as the snapshot sees them. Creating the export waits for running
        transactions, so a column added meanwhile is in the snapshot's rows: the copy must select it,
        or the ADD COLUMN's Relation later looks new and its default overwrites the copied values."""
        with self._inside(f"the publication(s) {', '.join(publications)} were described") as conn:
            return published_tables(conn, publications)

    def _inside(self, before: str) -> AbstractContextManager[psycopg.Connection]:
        return snapshot_transaction(self.conninfo, self.name, f"the exported snapshot {self.name} of temporary slot "
                                    f"{self.slot}", before)


@dataclass(frozen=True)
class CopyRange:
    """Heap pages ``[first_page, end_page)`` of one storage relation of a table (the table itself, or
    a leaf partition of a partition root); ``end_page`` None: to its end."""

    source: int  # the storage relation's index in ``copy_sources``
    namespace: str
    name: str
    first_page: int
    end_page: int | None


def copy_sources(conn: psycopg.Connection, table: PublishedTable) -> list[tuple[int, str, str]]:
    """The relations that store a published table's rows: (OID, schema, name) of the table, or of
    each leaf partition of a partition root, in OID order."""
    relation = table.relation
    if not table.partitioned:
        return [(relation.oid, relation.namespace, relation.name)]
    return [(int(oid), namespace, name) for oid, namespace, name in conn.execute(
        "SELECT c.oid, n.nspname, c.relname FROM pg_partition_tree(%s) t JOIN pg_class c ON c.oid = t.relid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.isleaf AND c.relkind = 'r' ORDER BY c.oid",
        (relation.oid,)).fetchall()]


def read_range(conninfo: str, snapshot: str, table: PublishedTable, pages: CopyRange,
               chunk_rows: int) -> Iterator[CopyData]:
    """One range of a table's rows at an exported snapshot, on a connection of its own (a Spark
    task's): ``COPY (SELECT ... WHERE ctid in the range AND <row filter>)``, which PostgreSQL 14+
    reads by a TID range scan, ``chunk_rows`` at a time."""
    source = sql.SQL("ONLY {}").format(sql.Identifier(pages.namespace, pages.name))
    bounds = [sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({pages.first_page},0)"))]
    if pages.end_page is not None:
        bounds.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({pages.end_page},0)")))
    where = f"COPY of {table.qualified_name} ({pages.namespace}.{pages.name} pages {pages.first_page}.." \
            f"{'' if pages.end_page is None else pages.end_page})"
    with snapshot_transaction(conninfo, snapshot, f"the exported snapshot {snapshot}", where) as conn:
        yield from _copy_chunks(conn, table, source, bounds, (), chunk_rows, where)


@contextmanager
def snapshot_transaction(conninfo: str, snapshot: str, described: str, before: str) -> Iterator[psycopg.Connection]:
    """A read-only transaction that sees exactly the exported ``snapshot``."""
    with psycopg.connect(conninfo) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        try:
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        except (psycopg.errors.UndefinedObject, psycopg.errors.InvalidParameterValue):
            raise SnapshotLost(f"{described} is gone (its connection ended) before {before}") from None
        try:
            yield conn
        finally:
            conn.rollback()


@dataclass(frozen=True)
class CopyData:
    """Whole rows of a text-format COPY, the ``first_row``-th (from 0) of the copy first."""

    data: bytes
    first_row: int
    where: str  # the copy, for errors

    def located(self, row: int | None) -> str:
        """Names a row of the chunk (None: the chunk) in an error."""
        if row is None:
            return f"{self.where}, rows {self.first_row + 1}.."
        return f"{self.where}, row {self.first_row + row + 1}"


def _copy_chunks(conn: psycopg.Connection, table: PublishedTable, source: sql.Composable,
                 conditions: list[sql.Composable], order_by: Sequence[str], chunk_rows: int,
                 where: str) -> Iterator[CopyData]:
    """``COPY (SELECT <published columns> FROM source WHERE conditions AND <row filter>)``,
    ``chunk_rows`` rows at a time; ``where`` names the copy in errors."""
    relation = table.relation
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in relation.columns)
    query = sql.SQL("SELECT {} FROM {}").format(columns, source)
    if table.row_filter:
        conditions = [*conditions, sql.SQL(table.row_filter)]  # type: ignore[arg-type]
    if conditions:
        query = sql.SQL("{} WHERE {}").format(query, sql.SQL(" AND ").join(sql.SQL("({})").format(c) for c in conditions))
    if order_by:
        query = sql.SQL("{} ORDER BY {}").format(query, sql.SQL(", ").join(map(sql.Identifier, order_by)))
    conn.execute("SET client_encoding TO 'UTF8'")  # the values go to the converters as UTF-8 bytes
    copied = 0
    with conn.cursor().copy(sql.SQL("COPY ({}) TO STDOUT").format(query)) as copy:
        chunk = bytearray()
        count = 0
        for data in copy:  # one row per message
            chunk += data
            count += 1
            if count >= chunk_rows:
                yield CopyData(bytes(chunk), copied, where)
                copied += count
                chunk, count = bytearray(), 0
        if count:
            yield CopyData(bytes(chunk), copied, where)


_TABLES_QUERY = """
SELECT c.oid, n.nspname, c.relname, c.relreplident, p.attnames::text[], {rowfilter}, c.relkind = 'p', p.pubname
FROM pg_publication_tables p
JOIN pg_namespace n ON n.nspname = p.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename
WHERE p.pubname = ANY(%s) ORDER BY n.nspname, c.relname, p.pubname
"""

_COLUMNS_QUERY = """
SELECT a.attname, a.atttypid, a.atttypmod,
       CASE c.relreplident
         WHEN 'f' THEN true
         WHEN 'd' THEN a.attnum = ANY (SELECT unnest(i.indkey) FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary)
         WHEN 'i' THEN a.attnum = ANY (SELECT unnest(i.indkey) FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)
         ELSE false END
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND (a.attgenerated = '' OR (%s AND a.attgenerated = 's'))
ORDER BY a.attnum
"""


def published_tables(conn: psycopg.Connection, publications: Sequence[str]) -> list[PublishedTable]:
    """Every table of the publications, described as pgoutput describes it.

    A table in several publications is sent once, as pgoutput combines them: its row filters are
    OR-ed (no filter when one publication has none) and its column lists must agree, or pgoutput
    refuses to decode it. Generated columns: PostgreSQL 18 sends a stored one when a publication's
    column list names it or ``publish_generated_columns = stored`` (its ``attnames`` then list it);
    older servers never send them, though their ``attnames`` list them."""
    version = int(conn.info.server_version)
    query = _TABLES_QUERY.format(rowfilter="p.rowfilter" if version >= 150000 else "NULL::text")
    if version < 150000:
        query = query.replace("p.attnames::text[]", "NULL::text[]")
    by_oid: dict[int, list[tuple]] = {}  # type: ignore[type-arg]
    for row in conn.execute(query, (list(publications),)).fetchall():
        by_oid.setdefault(row[0], []).append(row)
    tables = []
    for oid, rows in by_oid.items():
        _, namespace, name, identity, published_columns, _, partitioned, _ = rows[0]
        differing = {tuple(r[4] or ()) for r in rows}
        if len(differing) > 1:
            raise CdcApplyError(f"{namespace}.{name}: publications {', '.join(r[7] for r in rows)} publish different "
                                "column lists of it, which pgoutput refuses to decode; give it one column list")
        filters = [r[5] for r in rows]
        row_filter = None if None in filters else " OR ".join(f"({f})" for f in filters) if len(filters) > 1 \
            else filters[0]
        columns = tuple(
            m.RelationColumn(KEY_FLAG if is_key else 0, column, type_oid, typmod)
            for column, type_oid, typmod, is_key in conn.execute(_COLUMNS_QUERY, (oid, version >= 180000)).fetchall()
            if published_columns is None or column in published_columns)
        tables.append(PublishedTable(m.Relation(None, oid, namespace, name, identity, columns), row_filter,
                                     partitioned))
    return tables
