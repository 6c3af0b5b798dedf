"""Committed transactions -> change rows (DESIGN.md contract), per table, as Arrow tables.

A table's changes are split into segments at each new Relation definition, so every segment has
one fixed image type; segments of one table come out in stream order.

Two builders give the same rows (tests/test_columnar.py holds them equal): ``change_row``
converts change by change (the reference, and the path for snapshot chunks, whose images are
already decoded), and ``change_columns.change_table`` converts a whole column at a time (the
path for everything read from the stream). ``TableChanges.rows`` are the Arrow rows as Python
values for the apply's collapse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from operator import attrgetter
from typing import Any

import pyarrow as pa

from cdc_apply.assemble import Change, Transaction
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn, pg_us_to_unix_us
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import PgType, TypeCache, ValueConversionError
from cdc_apply.pgtypes.sparktypes import arrow_type

_WIRE, _OP, _RELATION = attrgetter("wire"), attrgetter("op"), attrgetter("relation")

CHANGE_ROW_COLUMNS = ("commit_lsn", "commit_ts", "xid", "seq", "origin", "relation_oid", "schema", "table", "op",
                      "key", "old", "new", "unchanged", "truncate_options")


class ColumnCodec:
    """Converts one column's raw bytes (text or binary) into its typed value."""

    __slots__ = ("name", "pg_type", "typmod", "arrow", "_text", "_binary")

    def __init__(self, column: m.RelationColumn, pg_type: PgType) -> None:
        self.name = column.name
        self.pg_type = pg_type
        self.typmod = column.typmod
        self.arrow = arrow_type(pg_type.spark_type(column.typmod))
        self._text: Callable[[str, int], Any] = pg_type.from_text
        self._binary: Callable[[bytes, int], Any] = pg_type.from_binary

    def convert(self, kind: int, raw: bytes) -> Any:
        if kind == m.KIND_TEXT:
            return self._text(raw.decode("utf-8"), self.typmod)
        return self._binary(raw, self.typmod)


@dataclass
class RelationCodec:
    relation: m.Relation
    columns: list[ColumnCodec]
    key_indexes: list[int]

    @classmethod
    def build(cls, relation: m.Relation, types: TypeCache) -> RelationCodec:
        columns = [ColumnCodec(col, types.get(col.type_oid)) for col in relation.columns]
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
                raise CdcApplyError(f"{where()}: column {column.name!r} ({column.pg_type.name}): {exc}") from None
        return out

    def unchanged(self, data: m.TupleData | None) -> list[str]:
        if data is None:
            return []
        return [self.columns[i].name for i in data.unchanged_columns()]


@dataclass
class TableChanges:
    """Changes of one table under one Relation definition, in stream order."""

    relation: m.Relation
    codec: RelationCodec
    transactions: list[Transaction] = field(default_factory=list)  # parallel to ``changes``
    changes: list[Change] = field(default_factory=list)

    @property
    def qualified_name(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"

    def schema(self) -> pa.Schema:
        return change_row_schema(self.codec)

    @property
    def from_stream(self) -> bool:
        """Every row change still holds its message bytes (truncates carry no images)."""
        undecoded = list(map(_WIRE, self.changes)).count(None)
        return undecoded == 0 or undecoded == "".join(map(_OP, self.changes)).count("T")

    def scalar_rows(self) -> list[dict[str, Any]]:
        """The change rows as Python values, converted change by change."""
        return [change_row(txn, change, self.codec) for txn, change in zip(self.transactions, self.changes)]

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        """The change rows as Python values: timestamps as microseconds, dates as days since 1970."""
        from cdc_apply.change_columns import NotArrowRepresentable, python_rows

        if not self.from_stream:
            return self.scalar_rows()
        try:
            return python_rows(self.to_arrow())
        except NotArrowRepresentable:
            return self.scalar_rows()

    def to_arrow(self) -> pa.Table:
        """The change rows as Arrow."""
        from cdc_apply.change_columns import change_table

        return change_table(self) if self.from_stream else pa.Table.from_pylist(self.scalar_rows(), schema=self.schema())


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


class ChangeRowBuilder:
    """Turns committed transactions into per-table change-row segments."""

    def __init__(self, types: TypeCache | None = None) -> None:
        self.types = types or TypeCache()
        self._codecs: dict[m.Relation, RelationCodec] = {}

    def codec(self, relation: m.Relation) -> RelationCodec:
        codec = self._codecs.get(relation)
        if codec is None:
            codec = self._codecs[relation] = RelationCodec.build(relation, self.types)
        return codec

    def build(self, transactions: Iterable[Transaction]) -> list[TableChanges]:
        segments: list[TableChanges] = []
        current: dict[int, TableChanges] = {}

        def segment_for(relation: m.Relation) -> TableChanges:
            segment = current.get(relation.oid)
            if segment is None or (segment.relation is not relation and segment.relation != relation):
                segment = current[relation.oid] = TableChanges(relation, self.codec(relation))
                segments.append(segment)
            return segment

        for txn in transactions:
            for type_message in txn.types:
                self.types.add(type_message.oid, type_message.namespace, type_message.name)
            changes = txn.changes
            if not changes:
                continue
            if len(set(map(id, map(_RELATION, changes)))) == 1:  # the common case: one table, one definition
                segment = segment_for(changes[0].relation)
                segment.transactions.extend(repeat(txn, len(changes)))
                segment.changes.extend(changes)
                continue
            for change in changes:
                segment = segment_for(change.relation)
                segment.transactions.append(txn)
                segment.changes.append(change)
        return segments


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


def change_rows(transactions: Iterable[Transaction], types: TypeCache | None = None) -> list[TableChanges]:
    return ChangeRowBuilder(types).build(transactions)
