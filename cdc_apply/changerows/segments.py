"""Committed transactions -> change rows (docs/architecture.md), per table, as Arrow tables.

A table's changes are split into segments at each new Relation definition, so every segment has
one fixed image type; segments of one table come out in stream order.

Two builders give the same rows (tests/test_golden_capture.py, test_type_roundtrip.py and
test_columnar_fuzz.py hold them equal): ``change_row`` converts change by change (the reference,
and the fallback for a value Arrow cannot hold), and ``changerows.columns.change_table`` converts a
whole column at a time (the path for everything read from the stream, and for snapshot chunks,
whose COPY values come as spans already). ``TableChanges.rows`` are the Arrow rows as Python
values for the apply's row-by-row collapse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import cached_property
from itertools import repeat
from operator import attrgetter
from typing import Any

import pyarrow as pa

from cdc_apply.transactions import Transaction
from cdc_apply.changerows.codec import (
    ColumnCodec, RelationCodec, Segment, change_row, change_row_schema, where_change,
)
from cdc_apply.changerows.columns import InsertedRows, NotArrowRepresentable, ParsedRows, change_table, python_rows
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import TypeCache

_RELATION = attrgetter("relation")

class TableChanges(Segment):
    """A segment with its change rows as Arrow and as Python values."""

    parsed: ParsedRows | None = None  # rows parsed already by their deliverer (foreach_batch, a snapshot chunk)

    @property
    def columnar(self) -> bool:
        """The column-at-a-time conversion takes the segment: its changes hold their message bytes,
        or they are a snapshot chunk's inserts, whose images are given."""
        return self.from_stream or isinstance(self.parsed, InsertedRows)

    def scalar_rows(self) -> list[dict[str, Any]]:
        if not isinstance(self.parsed, InsertedRows):
            return super().scalar_rows()
        return [change_row(txn, replace(change, new=new), self.codec)
                for txn, change, new in zip(self.transactions, self.changes, self.parsed.new_tuples())]

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        """The change rows as Python values: timestamps as microseconds, dates as days since 1970."""
        if not self.columnar:
            return self.scalar_rows()
        try:
            return python_rows(self.to_arrow())
        except NotArrowRepresentable:
            return self.scalar_rows()

    def to_arrow(self) -> pa.Table:
        """The change rows as Arrow (converted once: the columnar collapse and its fallback share them)."""
        return self._arrow

    @cached_property
    def _arrow(self) -> pa.Table:
        table = None if self.parsed is None else self.parsed.table(self)
        if table is not None:
            return table
        return change_table(self, self.parsed) if self.columnar else pa.Table.from_pylist(self.scalar_rows(), schema=self.schema())


class ChangeRowBuilder:
    """Turns committed transactions into per-table change-row segments."""

    def __init__(self, types: TypeCache | None = None) -> None:
        self.types = types or TypeCache()
        self._codecs: dict[m.Relation, RelationCodec] = {}

    @classmethod
    def with_codecs(cls, codecs: Iterable[RelationCodec]) -> ChangeRowBuilder:
        """A builder holding codecs built elsewhere (by the driver, for a Spark task)."""
        builder = cls()
        builder._codecs = {codec.relation: codec for codec in codecs}
        return builder

    def codec(self, relation: m.Relation) -> RelationCodec:
        codec = self._codecs.get(relation)
        if codec is None:
            codec = self._codecs[relation] = RelationCodec.build(relation, self.types)
        return codec

    def forget(self, relation_oid: int) -> None:
        """Drop the table's codecs: its column types changed (a column switched to text)."""
        for relation in [r for r in self._codecs if r.oid == relation_oid]:
            del self._codecs[relation]

    def rebuilt(self, segment: TableChanges) -> TableChanges:
        """The segment's changes again, with the codec its Relation has now (nothing converted yet)."""
        again = TableChanges(segment.relation, self.codec(segment.relation), segment.transactions, segment.changes)
        again.parsed = segment.parsed
        return again

    def build(self, transactions: Iterable[Transaction], parsed: ParsedRows | None = None) -> list[TableChanges]:
        """``parsed``: the transactions' change rows as their deliverer parsed them (``TableChanges.parsed``)."""
        segments: list[TableChanges] = []
        current: dict[int, TableChanges] = {}

        def segment_for(relation: m.Relation) -> TableChanges:
            segment = current.get(relation.oid)
            if segment is None or (segment.relation is not relation and segment.relation != relation):
                segment = current[relation.oid] = TableChanges(relation, self.codec(relation))
                segment.parsed = parsed
                segments.append(segment)
            return segment

        for txn in transactions:
            for type_message in txn.types:
                self.types.add(type_message.oid, type_message.namespace, type_message.name, type_message.facts)
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


def change_rows(transactions: Iterable[Transaction], types: TypeCache | None = None) -> list[TableChanges]:
    return ChangeRowBuilder(types).build(transactions)


__all__ = ["ChangeRowBuilder", "ColumnCodec", "RelationCodec", "TableChanges", "change_row", "change_row_schema",
           "change_rows", "where_change"]
