"""Committed transactions -> change rows (DESIGN.md contract), per table, as Arrow tables.

A table's changes are split into segments at each new Relation definition, so every segment has
one fixed image type; segments of one table come out in stream order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cdc_apply.assemble import Change, Transaction
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn, pg_us_to_unix_us
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import PgType, TypeCache, ValueConversionError
from cdc_apply.pgtypes.sparktypes import arrow_type

CHANGE_ROW_COLUMNS = ("commit_lsn", "commit_ts", "xid", "seq", "origin", "relation_oid", "schema", "table", "op",
                      "key", "old", "new", "unchanged", "truncate_options")


class _ColumnCodec:
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
    columns: list[_ColumnCodec]
    key_indexes: list[int]

    @classmethod
    def build(cls, relation: m.Relation, types: TypeCache) -> RelationCodec:
        columns = [_ColumnCodec(col, types.get(col.type_oid)) for col in relation.columns]
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
    """Change rows of one table under one Relation definition."""

    relation: m.Relation
    codec: RelationCodec
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def qualified_name(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"

    def schema(self) -> pa.Schema:
        return change_row_schema(self.codec)

    def to_arrow(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=self.schema())


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
        for txn in transactions:
            for type_message in txn.types:
                self.types.add(type_message.oid, type_message.namespace, type_message.name)
            for change in txn.changes:
                segment = current.get(change.relation.oid)
                if segment is None or segment.relation != change.relation:
                    segment = TableChanges(change.relation, self.codec(change.relation))
                    current[change.relation.oid] = segment
                    segments.append(segment)
                segment.rows.append(self.row(txn, change, segment.codec))
        return segments

    def row(self, txn: Transaction, change: Change, codec: RelationCodec) -> dict[str, Any]:
        def where() -> str:
            return f"LSN {format_lsn(change.lsn)} (transaction {txn.xid}, change {change.seq})"

        relation = change.relation
        key_source = change.key or change.old or change.new
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
            "old": codec.image(change.old, None, where),
            "new": codec.image(change.new, None, where),
            "unchanged": codec.unchanged(change.new),
            "truncate_options": change.truncate_options if change.op == "T" else None,
        }


def change_rows(transactions: Iterable[Transaction], types: TypeCache | None = None) -> list[TableChanges]:
    return ChangeRowBuilder(types).build(transactions)
