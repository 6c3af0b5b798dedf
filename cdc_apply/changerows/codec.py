"""Change rows of one table under one Relation definition: the column codecs, the segment, and the
change-by-change reference conversion (the contract of every change row is in docs/architecture.md).

``changerows.columns`` converts a whole segment a column at a time and ``changerows.segments`` cuts
transactions into segments; both build on this module, which imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import pyarrow as pa

from cdc_apply.changerows.run_rows import RunRows
from cdc_apply.transactions import Change, Transaction
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn, pg_us_to_unix_us
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import PgType, TypeCache, UnrepresentableValueError, ValueConversionError, portable_type_cache
from cdc_apply.pgtypes.sparktypes import arrow_type

_WIRE, _OP = attrgetter("wire"), attrgetter("op")


class ColumnCodec:
    """Converts one column's raw bytes (text or binary) into its typed value."""

    __slots__ = ("name", "table", "pg_type", "typmod", "arrow", "_text", "_binary")

    def __init__(self, column: m.RelationColumn, pg_type: PgType, table: str = "") -> None:
        self.name = column.name
        self.table = table  # schema.table, for the config key an error names
        self.pg_type = pg_type
        self.typmod = column.typmod
        self.arrow = arrow_type(pg_type.spark_type(column.typmod))
        self._text: Callable[[str, int], Any] = pg_type.from_text
        self._binary: Callable[[bytes, int], Any] = pg_type.from_binary

    def convert(self, kind: int, raw: bytes) -> Any:
        if kind == m.KIND_TEXT:
            return self._text(raw.decode("utf-8"), self.typmod)
        return self._binary(raw, self.typmod)

    def conversion_error(self, where: str, exc: Exception) -> CdcApplyError:
        """A located error for a value of this column; for a valid value the type cannot hold, it
        names the config key that keeps it as text."""
        message = f"{where}: column {self.name!r} ({self.pg_type.name}): {exc}"
        if isinstance(exc, UnrepresentableValueError):
            return UnrepresentableColumnError(self.table, self.name, message)
        return CdcApplyError(message)


class UnrepresentableColumnError(CdcApplyError):
    """A valid value of a source column that the column's mapped type cannot hold (NaN in
    ``numeric(p,s)``, a multi-dimensional array): the message names the config key that keeps the
    column as PostgreSQL's text; ``schema_policy: evolve`` switches the column to it by itself."""

    def __init__(self, table: str, column: str, message: str) -> None:
        super().__init__(message + keep_as_text_hint(table, column))
        self.table = table  # schema.table
        self.column = column  # the source column


def keep_as_text_hint(table: str, column: str) -> str:
    """The config key that keeps a column's values as PostgreSQL's text, for an error to name."""
    return (f"; to keep it, set tables.\"{table}\".columns.\"{column}\".type: string in the config "
            "(docs/apply.md, \"Values a column's type cannot hold\")")


@dataclass
class RelationCodec:
    relation: m.Relation
    columns: list[ColumnCodec]
    key_indexes: list[int]

    @classmethod
    def build(cls, relation: m.Relation, types: TypeCache) -> RelationCodec:
        table = f"{relation.namespace}.{relation.name}"
        columns = [ColumnCodec(col, types.for_column(relation.namespace, relation.name, col.name, col.type_oid), table)
                   for col in relation.columns]
        return cls(relation, columns, [i for i, col in enumerate(relation.columns) if col.is_key])

    def image_type(self, indexes: Iterable[int] | None = None) -> pa.StructType:
        chosen = range(len(self.columns)) if indexes is None else indexes
        return pa.struct([pa.field(self.columns[i].name, self.columns[i].arrow) for i in chosen])

    def image(self, data: m.TupleData | None, indexes: list[int] | None, where: Callable[[], str]) -> dict[str, Any] | None:
        if data is None:
            return None
        if len(data.kinds) != len(self.columns):
            raise CdcApplyError(f"{where()}: tuple has {len(data.kinds)} columns, relation "
                                f"{self.relation.namespace}.{self.relation.name} has {len(self.columns)}")
        chosen = range(len(self.columns)) if indexes is None else indexes
        out: dict[str, Any] = {}
        for i in chosen:
            kind = data.kinds[i]
            raw = data.values[i]
            column = self.columns[i]
            if raw is None:
                out[column.name] = None
                continue
            try:
                out[column.name] = column.convert(kind, raw)
            except (ValueConversionError, UnicodeDecodeError, ValueError) as exc:
                raise column.conversion_error(where(), exc) from None
        return out

    def unchanged(self, data: m.TupleData | None) -> list[str]:
        if data is None:
            return []
        return [self.columns[i].name for i in data.unchanged_columns()]


@dataclass(frozen=True)
class PortableCodec:
    """What a Spark task needs to build a relation's codec as the driver has it (a codec holds
    converters that do not pickle): the Relation, the columns kept as PostgreSQL's exact text, and
    the custom types (``TypeCache.named``)."""

    relation: m.Relation
    text_columns: frozenset[str]
    custom_types: Mapping[int, tuple[str, str, str | None]]

    def build(self) -> RelationCodec:
        return RelationCodec.build(self.relation, portable_type_cache(self.text_columns, self.custom_types))


@dataclass
class Segment:
    """Changes of one table under one Relation definition, in stream order."""

    relation: m.Relation
    codec: RelationCodec
    transactions: list[Transaction] = field(default_factory=list)  # parallel to ``changes``
    changes: list[Change] | RunRows = field(default_factory=list)  # RunRows: the rows of runs' columns

    @property
    def qualified_name(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"

    def schema(self) -> pa.Schema:
        return change_row_schema(self.codec)

    @property
    def from_stream(self) -> bool:
        """Every row change still holds its message bytes (truncates carry no images)."""
        if isinstance(self.changes, RunRows):
            return True  # its listed changes hold their messages (RunRows.takes)
        undecoded = list(map(_WIRE, self.changes)).count(None)
        return undecoded == 0 or undecoded == "".join(map(_OP, self.changes)).count("T")

    def scalar_rows(self) -> list[dict[str, Any]]:
        """The change rows as Python values, converted change by change."""
        return [change_row(txn, change, self.codec) for txn, change in zip(self.transactions, self.changes)]


def change_row_schema(codec: RelationCodec) -> pa.Schema:
    return pa.schema([
        pa.field("commit_lsn", pa.int64(), nullable=False),
        pa.field("commit_ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("xid", pa.int64(), nullable=False),
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("origin", pa.string()),
        pa.field("relation_oid", pa.int64(), nullable=False),
        pa.field("schema", pa.string(), nullable=False),
        pa.field("table", pa.string(), nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("key", codec.image_type(codec.key_indexes)),
        pa.field("old", codec.image_type()),
        pa.field("new", codec.image_type()),
        pa.field("unchanged", pa.list_(pa.string())),
        pa.field("truncate_options", pa.int8()),
    ])


def where_change(txn: Transaction, change: Change) -> str:
    place = f"LSN {format_lsn(change.lsn)} (transaction {txn.xid}, change {change.seq})"
    return f"{change.source}, {place}" if change.source else place


def change_row(txn: Transaction, change: Change, codec: RelationCodec) -> dict[str, Any]:
    def where() -> str:
        return where_change(txn, change)

    relation = change.relation
    key, old, new = change.images()
    key_source = key or old or new
    return {
        "commit_lsn": txn.commit_lsn,
        "commit_ts": pg_us_to_unix_us(txn.commit_ts),
        "xid": txn.xid,
        "seq": change.seq,
        "origin": txn.origin,
        "relation_oid": relation.oid,
        "schema": relation.namespace,
        "table": relation.name,
        "op": change.op,
        "key": codec.image(key_source, codec.key_indexes, where) if change.op != "T" else None,
        "old": codec.image(old, None, where),
        "new": codec.image(new, None, where),
        "unchanged": codec.unchanged(new),
        "truncate_options": change.truncate_options if change.op == "T" else None,
    }
