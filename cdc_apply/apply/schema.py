"""Relation messages -> typed schema-change events -> target actions under a per-table policy.

This module decides; ``cdc_apply.apply.evolve`` carries the actions out on Delta. The state it
works from is ``SourceColumn``: each source column the target has seen, with the target column it
feeds (None: its values are dropped, under the ``ignore`` policy).

Rename detection (the Relation message carries no attnum): a column that disappears and a column
that appears at the same position with the same Spark type are a rename. Anything else is a drop
plus an add. See docs/apply.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cdc_apply.errors import CdcApplyError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import TypeCache


class SchemaPolicyError(CdcApplyError):
    """A schema change that the table's policy (``fail``) refuses."""


@dataclass(frozen=True)
class SourceColumn:
    name: str
    spark_type: str
    target: str | None


# --- events: what changed at the source --------------------------------------------------------
@dataclass(frozen=True)
class ColumnAdded:
    column: str
    spark_type: str


@dataclass(frozen=True)
class ColumnDropped:
    column: str


@dataclass(frozen=True)
class ColumnRenamed:
    old: str
    new: str


@dataclass(frozen=True)
class TypeChanged:
    column: str
    old_type: str
    new_type: str

    @property
    def widening(self) -> bool:
        return is_widening(self.old_type, self.new_type)


SchemaEvent = ColumnAdded | ColumnDropped | ColumnRenamed | TypeChanged


# --- actions: what happens to the Delta table --------------------------------------------------
@dataclass(frozen=True)
class AddTargetColumn:
    column: str
    spark_type: str


@dataclass(frozen=True)
class WidenTargetColumn:
    column: str
    spark_type: str


@dataclass(frozen=True)
class DropTargetColumn:
    column: str


@dataclass(frozen=True)
class RenameTargetColumn:
    old: str
    new: str


@dataclass(frozen=True)
class RetypeTargetColumn:
    """An incompatible type change under ``evolve``: the column is rewritten with a cast."""

    column: str
    spark_type: str


@dataclass(frozen=True)
class BackfillTargetColumn:
    """Rows committed before ``before_lsn`` get ``value``: what PostgreSQL gives rows that existed
    before ``ADD COLUMN ... DEFAULT`` without writing them to the WAL."""

    column: str
    spark_type: str
    value: Any
    before_lsn: int


TargetAction = (AddTargetColumn | WidenTargetColumn | DropTargetColumn | RenameTargetColumn | RetypeTargetColumn
                | BackfillTargetColumn)

_INTEGERS = ("smallint", "int", "bigint")
_DECIMAL = re.compile(r"decimal\((\d+),(\d+)\)")


def is_widening(old: str, new: str) -> bool:
    """The type changes Delta's type widening applies in place."""
    if old in _INTEGERS and new in _INTEGERS:
        return _INTEGERS.index(new) > _INTEGERS.index(old)
    if (old, new) in {("float", "double"), ("date", "timestamp_ntz")}:
        return True
    old_dec, new_dec = _DECIMAL.fullmatch(old), _DECIMAL.fullmatch(new)
    if old_dec and new_dec:
        (p1, s1), (p2, s2) = map(int, old_dec.groups()), map(int, new_dec.groups())
        return (p2, s2) != (p1, s1) and s2 >= s1 and p2 - s2 >= p1 - s1
    return False


_NUMBERS = ("tinyint", *_INTEGERS, "float", "double", "boolean")
_TIMES = ("date", "timestamp", "timestamp_ntz")


def castable(old: str, new: str) -> bool:
    """Whether a target column of Spark type ``old`` can be rewritten as ``new`` by Spark's cast (or,
    for an array into text, as PostgreSQL's array literal: ``evolve._retyped``). Not: between a
    nested type and a scalar other than text (``string`` into ``array<string>``: a copy made by
    an older mapping), or across families (an int into a date)."""
    if old == new or new == "string":
        return True
    old_array, new_array = _array_element(old), _array_element(new)
    if old_array is not None or new_array is not None:
        return old_array is not None and new_array is not None and castable(old_array, new_array)
    if old.startswith(("struct<", "map<")) or new.startswith(("struct<", "map<")):
        return False
    numeric = lambda t: t in _NUMBERS or _DECIMAL.fullmatch(t) is not None  # noqa: E731
    if numeric(old) and numeric(new):
        return True
    if old in _TIMES and new in _TIMES:
        return True
    return old == "string" and (numeric(new) or new in _TIMES or new == "binary")


def _array_element(spark_type: str) -> str | None:
    return spark_type[len("array<"):-1] if spark_type.startswith("array<") and spark_type.endswith(">") else None


def relation_columns(relation: m.Relation, types: TypeCache) -> list[tuple[str, str]]:
    """(name, Spark type) of every column of a Relation message."""
    return [(col.name, types.for_column(relation.namespace, relation.name, col.name, col.type_oid).spark_type(col.typmod))
            for col in relation.columns]


def diff(previous: Sequence[SourceColumn], current: Sequence[tuple[str, str]]) -> list[SchemaEvent]:
    before = {col.name: col for col in previous}
    after = dict(current)
    events: list[SchemaEvent] = []
    gone = [col for col in previous if col.name not in after]
    new = [(i, name) for i, (name, _) in enumerate(current) if name not in before]
    renamed_from: dict[str, str] = {}
    surviving = [col.name for col in previous]
    for position, name in new:
        # the column that stood at this position before, if it is gone and has the same type
        if position < len(surviving):
            candidate = before[surviving[position]]
            if candidate in gone and candidate.spark_type == after[name] and candidate.name not in renamed_from:
                renamed_from[candidate.name] = name
    for col in gone:
        if col.name in renamed_from:
            events.append(ColumnRenamed(col.name, renamed_from[col.name]))
        else:
            events.append(ColumnDropped(col.name))
    for name, spark_type in current:
        if name in before and before[name].spark_type != spark_type:
            events.append(TypeChanged(name, before[name].spark_type, spark_type))
        elif name not in before and name not in renamed_from.values():
            events.append(ColumnAdded(name, spark_type))
    return events


class ColumnNamer:
    """Target column names: the source name, unless Delta would see it as taken.

    Delta compares names without case, so ``Value`` after ``value`` (or a column added under a
    name a kept column holds) becomes ``<name>__<type>``, then ``<name>__<type>_2``, ...
    """

    def __init__(self, existing: Iterable[str] = ()) -> None:
        self.taken = {name.lower() for name in existing}

    def name(self, wanted: str, spark_type: str) -> str:
        candidate = wanted
        if candidate.lower() in self.taken:
            candidate = f"{wanted}__{re.sub(r'[^a-z0-9]+', '_', spark_type.lower()).strip('_')}"
            base, number = candidate, 2
            while candidate.lower() in self.taken:
                candidate, number = f"{base}_{number}", number + 1
        self.taken.add(candidate.lower())
        return candidate


def initial_columns(current: Sequence[tuple[str, str]], reserved: Iterable[str] = ()) -> list[SourceColumn]:
    namer = ColumnNamer(reserved)
    return [SourceColumn(name, spark_type, namer.name(name, spark_type)) for name, spark_type in current]


@dataclass
class Plan:
    actions: list[TargetAction]
    columns: list[SourceColumn]  # the new source -> target state


def plan(events: Sequence[SchemaEvent], previous: Sequence[SourceColumn], current: Sequence[tuple[str, str]],
         target_types: dict[str, str], policy: str, where: str,
         retyped_by_config: frozenset[str] = frozenset(), type_widening: str = "rewrite") -> Plan:
    """Decide the target actions for ``events`` under ``policy``.

    ``target_types`` is the target's current data columns (name -> Spark type); ``where`` names the
    table and LSN for errors. A type change of a column in ``retyped_by_config`` (the config maps it
    to ``string``) rewrites the target column in place under every policy: the user asked for it.
    A widening, under every policy, rewrites the column (``type_widening: rewrite``, which every
    reader can read) or uses Delta's type widening feature (``feature``, no rewrite).
    """
    targets = {col.name: col.target for col in previous}
    actions: list[TargetAction] = []
    fresh_column = ColumnNamer(target_types).name

    def refuse(event: SchemaEvent) -> None:
        raise SchemaPolicyError(f"{where}: schema policy 'fail' refuses {describe(event)}")

    for event in events:
        if isinstance(event, ColumnAdded):
            existing = target_types.get(event.column)
            if existing == event.spark_type and event.column not in targets:
                targets[event.column] = event.column  # a column kept by an earlier drop, same type
            else:
                column = fresh_column(event.column, event.spark_type)
                actions.append(AddTargetColumn(column, event.spark_type))
                targets[event.column] = column
        elif isinstance(event, TypeChanged):
            target = targets.get(event.column)
            if target is None:
                continue
            if event.widening:
                widen = WidenTargetColumn if type_widening == "feature" else RetypeTargetColumn
                actions.append(widen(target, event.new_type))
            elif event.column in retyped_by_config:
                actions.append(RetypeTargetColumn(target, event.new_type))
            elif policy == "fail":
                refuse(event)
            elif policy == "evolve":
                actions.append(RetypeTargetColumn(target, event.new_type))
            elif policy == "lenient":
                column = fresh_column(event.column, event.new_type)
                actions.append(AddTargetColumn(column, event.new_type))
                targets[event.column] = column
            # ignore: values keep flowing into the old column, cast to its type (ANSI: loud on failure)
        elif isinstance(event, ColumnRenamed):
            target = targets.pop(event.old, None)
            if policy == "fail":
                refuse(event)
            elif policy == "evolve" and target is not None:
                new_target = fresh_column(event.new, target_types.get(target, ""))
                actions.append(RenameTargetColumn(target, new_target))
                targets[event.new] = new_target
            elif policy == "lenient":
                spark_type = dict(current)[event.new]
                column = fresh_column(event.new, spark_type)
                actions.append(AddTargetColumn(column, spark_type))
                targets[event.new] = column
            else:  # ignore: the renamed column keeps feeding the old target column
                targets[event.new] = target
        elif isinstance(event, ColumnDropped):
            target = targets.pop(event.column, None)
            if policy == "fail":
                refuse(event)
            elif policy == "evolve" and target is not None:
                actions.append(DropTargetColumn(target))
            # lenient and ignore: the target column stays, NULL in rows written from now on
    columns = [SourceColumn(name, spark_type, targets.get(name)) for name, spark_type in current]
    return Plan(actions, columns)


def describe(event: SchemaEvent) -> str:
    if isinstance(event, ColumnAdded):
        return f"added column {event.column!r} ({event.spark_type})"
    if isinstance(event, ColumnDropped):
        return f"dropped column {event.column!r}"
    if isinstance(event, ColumnRenamed):
        return f"renamed column {event.old!r} to {event.new!r}"
    return f"type change of column {event.column!r} from {event.old_type} to {event.new_type}"
