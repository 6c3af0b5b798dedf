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

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import cached_property
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np
import pyarrow as pa

from cdc_apply.changerows.run_rows import RunRows
from cdc_apply.transactions import Change, RunChanges, RunColumns, Transaction
from cdc_apply.changerows.codec import (
    ColumnCodec, RelationCodec, Segment, change_row, change_row_schema, where_change,
)
from cdc_apply.changerows.columns import InsertedRows, NotArrowRepresentable, ParsedRows, change_table, python_rows
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import TypeCache

_RELATION = attrgetter("relation")
_CHANGES = attrgetter("changes")

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
        """``parsed``: the transactions' change rows as their deliverer parsed them (``TableChanges.parsed``).

        Consecutive transactions whose changes are one run's columns (``RunChanges``, the walsender's
        reads) are cut into segments together, by numpy, with no ``Change`` made; the segments they
        make then hold ``RunRows``. Every other transaction is cut change by change."""
        segments: list[TableChanges] = []
        current: dict[int, TableChanges] = {}

        def segment_for(relation: m.Relation) -> TableChanges:
            segment = current.get(relation.oid)
            if segment is None or (segment.relation is not relation and segment.relation != relation):
                segment = current[relation.oid] = TableChanges(relation, self.codec(relation))
                segment.parsed = parsed
                segments.append(segment)
            return segment

        from_runs: list[Transaction] = []
        for txn in transactions:
            for type_message in txn.types:
                self.types.add(type_message.oid, type_message.namespace, type_message.name, type_message.facts)
            changes = txn.changes
            if not changes:
                continue
            if isinstance(changes, RunChanges):
                if from_runs and from_runs[-1].changes.run is not changes.run:  # type: ignore[union-attr]
                    _cut_run(from_runs, segment_for)
                    from_runs = []
                from_runs.append(txn)
                continue
            if from_runs:
                _cut_run(from_runs, segment_for)
                from_runs = []
            if len(set(map(id, map(_RELATION, changes)))) == 1:  # the common case: one table, one definition
                segment = segment_for(changes[0].relation)
                _add_listed(segment, list(changes))
                segment.transactions.extend(repeat(txn, len(changes)))
                continue
            by_segment: dict[int, tuple[TableChanges, list[Change]]] = {}  # each segment's changes, in order
            for change in changes:
                segment = segment_for(change.relation)
                by_segment.setdefault(id(segment), (segment, []))[1].append(change)
            for segment, listed in by_segment.values():
                _add_listed(segment, listed)
                segment.transactions.extend(repeat(txn, len(listed)))
        if from_runs:
            _cut_run(from_runs, segment_for)
        return segments


def _add_listed(segment: TableChanges, changes: list[Change]) -> None:
    if isinstance(segment.changes, RunRows):
        if RunRows.takes(changes):
            segment.changes.add(changes)
            return
        segment.changes = list(segment.changes)
    segment.changes.extend(changes)


def _add_run_rows(segment: TableChanges, run: RunColumns, rows: np.ndarray) -> None:
    changes = segment.changes
    if not isinstance(changes, RunRows):
        if changes and not RunRows.takes(changes):
            changes.extend(run.all_changes()[row] for row in rows.tolist())
            return
        segment.changes = RunRows()
        if changes:
            segment.changes.add(changes)
    segment.changes.add((run, rows))


def _cut_run(transactions: list[Transaction], segment_for: Callable[[m.Relation], TableChanges]) -> None:
    """Transactions whose changes are rows of one run, in order, added to their tables' segments.
    A run holds one definition per table, so a table's rows go to one segment, in stream order."""
    run = transactions[0].changes.run  # type: ignore[union-attr]
    starts = np.fromiter((t.changes.start for t in transactions), np.int64, len(transactions))  # type: ignore[union-attr]
    counts = np.fromiter(map(len, map(_CHANGES, transactions)), np.int64, len(transactions))
    first_of = np.cumsum(counts) - counts
    rows = np.arange(int(counts.sum())) + np.repeat(starts - first_of, counts)
    relation_at = run.relation_at[rows]
    by_transaction = np.empty(len(transactions), object)
    by_transaction[:] = transactions
    transaction_of = np.repeat(np.arange(len(transactions)), counts)
    present, first_row = np.unique(relation_at, return_index=True)
    for relation_index in present[np.argsort(first_row)].tolist():
        segment = segment_for(run.relations[relation_index])
        mine = rows if len(present) == 1 else rows[relation_at == relation_index]
        taken = by_transaction[transaction_of if len(present) == 1 else transaction_of[relation_at == relation_index]]
        _add_run_rows(segment, run, mine)
        segment.transactions.extend(taken.tolist())


def change_rows(transactions: Iterable[Transaction], types: TypeCache | None = None) -> list[TableChanges]:
    return ChangeRowBuilder(types).build(transactions)


__all__ = ["ChangeRowBuilder", "ColumnCodec", "RelationCodec", "TableChanges", "change_row", "change_row_schema",
           "change_rows", "where_change"]
