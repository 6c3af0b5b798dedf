"""The schema port of the apply: a target created for a table, evolved to each Relation it
receives, added columns backfilled, a column kept as PostgreSQL's text under ``evolve``.

``BatchApplier`` asks it before a segment's rows are collapsed; the data writer
(``apply/writer.py``) then writes into the schema it left. Each schema change is its own Delta
commit (``apply/evolve.py``), judged against the source state stored in the target.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from cdc_apply.apply.evolve import apply_actions
from cdc_apply.apply.options import ApplyOptions, TableOptions
from cdc_apply.apply.plan import MissingValueLookup, TableResult, initial_keys, later_keys, multiset
from cdc_apply.apply.schema import (
    BackfillTargetColumn, ColumnAdded, RenameTargetColumn, RetypeTargetColumn, SchemaEvent, SourceColumn, TypeChanged,
    castable, describe, diff, initial_columns, plan, relation_columns,
)
from cdc_apply.apply.target_state import TargetStates
from cdc_apply.apply.targets import SourceState, Target, metadata_columns
from cdc_apply.changerows.codec import UnrepresentableColumnError, keep_as_text_hint
from cdc_apply.changerows.segments import TableChanges
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import TypeCache

log = logging.getLogger(__name__)


class SchemaApplier:
    def __init__(self, options: ApplyOptions, target_states: TargetStates,
                 missing_value: MissingValueLookup | None = None) -> None:
        """``missing_value``: the live source's lookup of the value ``ADD COLUMN ... DEFAULT`` gave the
        rows that existed before it, for the backfill (None when there is no live source: replay)."""
        self.options = options
        self.target_states = target_states
        self.missing_value = missing_value
        self.types = TypeCache(column_types=self.column_type)
        # (schema, table, source column) kept as PostgreSQL's text because a value did not fit its
        # mapped type under schema_policy: evolve; each target records its own (SourceState.text_columns).
        self.text_columns: set[tuple[str, str, str]] = set()

    def keep_as_text(self, target: Target, relation: m.Relation, exc: UnrepresentableColumnError, lsn: int) -> None:
        """Under ``evolve``, the failing column from now on as PostgreSQL's text, its target column (if
        any) rewritten to it in its own commit at ``lsn``; else ``exc`` again."""
        options = self.options.for_table(relation.namespace, relation.name)
        column = (relation.namespace, relation.name, exc.column)
        if options.schema_policy != "evolve" or column in self.text_columns:
            raise exc
        self.text_columns.add(column)
        log.warning("%s: column %s switched to PostgreSQL's exact text (schema_policy evolve), since a value does not "
                    "fit its type: %s", exc.table, exc.column, exc)
        state = self.target_states.current(target).source
        if state is not None:
            columns = [SourceColumn(c.name, "string", c.target) if c.name == exc.column else c for c in state.columns]
            switched = replace(state, columns=columns, text_columns=(*state.text_columns, exc.column))
            data_types = target.data_types()
            retype = [RetypeTargetColumn(c.target, "string") for c in state.columns
                      if c.name == exc.column and c.target is not None and data_types.get(c.target) != "string"]
            apply_actions(target, retype, switched, format_lsn(lsn))
            self.target_states.forget(target)

    def column_type(self, schema: str, table: str, column: str) -> str | None:
        """The type a source column is converted to: the config's, or text where evolve switched it."""
        configured = self.options.column_type(schema, table, column)
        return configured or ("string" if (schema, table, column) in self.text_columns else None)

    def columns(self, relation: m.Relation, options: TableOptions) -> list[tuple[str, str]]:
        return [(name, spark_type) for name, spark_type in relation_columns(relation, self.types)
                if options.keeps_column(name)]

    def create(self, target: Target, relation: m.Relation, options: TableOptions,
                position: tuple[int, int], replace: bool = False) -> SourceState:
        current = self.columns(relation, options)
        columns = initial_columns(current, reserved=[name for name, _ in metadata_columns(options)])
        targets = {col.name: col.target for col in columns}
        keys = initial_keys(relation, options, set(targets))
        whole_row = relation.replica_identity == "f" and not options.keys
        state = SourceState(relation.oid, relation.namespace, relation.name,
                            tuple(targets[k] for k in keys), columns, position, whole_row=whole_row,  # type: ignore[misc]
                            text_columns=self.text_columns_of(relation))
        target.create(state, dict(current), options, self.options.table_properties, replace)
        log.info("%s %s for %s.%s (keys %s)", "replaced" if replace else "created", target.location,
                 relation.namespace, relation.name, keys)
        return state

    def exact_text_columns(self, relation: m.Relation, state: SourceState) -> frozenset[str]:
        """Source columns converted as PostgreSQL's exact text: the config's, and those evolve switched
        (in this run, or recorded in the target's ``state``). What a Spark task's codec needs to know
        (``changerows.codec.PortableCodec``, the copy's ``TableCopy``)."""
        return frozenset(c.name for c in relation.columns if c.name in state.text_columns
                         or self.column_type(relation.namespace, relation.name, c.name) == "string")

    def text_columns_of(self, relation: m.Relation) -> tuple[str, ...]:
        """The relation's columns evolve switched to PostgreSQL's text."""
        return tuple(c.name for c in relation.columns if (relation.namespace, relation.name, c.name) in self.text_columns)

    def keyed_as_is(self, state: SourceState, relation: m.Relation, options: TableOptions) -> bool:
        """One row per key (SCD type 1, not a whole-row key) and no schema change against ``state``
        (else the collapse path evolves the target first)."""
        return options.scd_type == 1 and not multiset(state, options) \
            and not diff(state.columns, self.columns(relation, options)) \
            and later_keys(state, relation, options) == (state.keys, state.whole_row)

    def evolve(self, target: Target, state: SourceState, segment: TableChanges, options: TableOptions,
                position: tuple[int, int], result: TableResult,
                backfills: list[BackfillTargetColumn]) -> tuple[SourceState, dict[str, str]]:
        """The state after this segment's Relation, and the target columns renamed on the way."""
        if position <= state.applied_at:
            return state, {}
        current = self.columns(segment.relation, options)
        events = diff(state.columns, current)
        if not events:
            keys, whole_row = later_keys(state, segment.relation, options)
            if (keys, whole_row) == (state.keys, state.whole_row):
                return state, {}
            keyed = SourceState(state.relation_oid, segment.relation.namespace, segment.relation.name, keys,
                                state.columns, position, state.merge_until, whole_row, state.text_columns)
            apply_actions(target, [], keyed, format_lsn(position[0]))
            return keyed, {}
        where = f"{segment.qualified_name} at LSN {format_lsn(position[0])}"
        data_types = target.data_types()
        text_columns = tuple(dict.fromkeys([*state.text_columns, *self.text_columns_of(segment.relation)]))
        self._check_castable(events, segment.relation, options, where, frozenset([*options.column_types, *text_columns]))
        decided = plan(events, state.columns, current, data_types, options.schema_policy, where,
                       retyped_by_config=frozenset([*options.column_types, *text_columns]),
                       type_widening=options.type_widening)
        targets = {col.name: col.target for col in decided.columns}
        renamed_keys = {a.old for a in decided.actions if isinstance(a, RenameTargetColumn)}
        missing_keys = [k for k in state.keys if k not in targets.values() and k not in renamed_keys]
        if missing_keys and not state.whole_row:
            raise CdcApplyError(f"{where}: key columns {missing_keys} no longer reach the target after "
                                f"{[describe(e) for e in events]}")
        renamed = {a.old: a.new for a in decided.actions if isinstance(a, RenameTargetColumn)}
        new_state = SourceState(state.relation_oid, segment.relation.namespace, segment.relation.name,
                                tuple(renamed.get(k, k) for k in state.keys), decided.columns, position,
                                state.merge_until, state.whole_row, text_columns)
        new_state.keys, new_state.whole_row = later_keys(new_state, segment.relation, options)
        added = [e for e in events if isinstance(e, ColumnAdded) and targets.get(e.column)]
        backfills += self._backfills(segment.relation, added, targets, options, position[0])
        apply_actions(target, [*decided.actions, *backfills], new_state, format_lsn(position[0]))
        result.schema_changes += [describe(e) for e in events]
        return new_state, renamed

    @staticmethod
    def _check_castable(events: list[SchemaEvent], relation: m.Relation, options: TableOptions, where: str,
                        retyped: frozenset[str]) -> None:
        """A type change no cast can carry between the target's column and the batch's values (a target
        copied under an older mapping: ``string`` against ``array<string>``) never reaches Spark as a
        failed cast. Under ``evolve`` the column switches to PostgreSQL's text (``apply_table`` catches
        the ``UnrepresentableColumnError``); under ``ignore``, whose values would be cast into the
        target's type, a clear error naming the config key. ``fail`` refuses every type change and
        ``lenient`` writes a new column: neither casts."""
        for event in events:
            if not isinstance(event, TypeChanged) or event.column in retyped:
                continue
            qualified = f"{relation.namespace}.{relation.name}"
            what = (f"{where}: column {event.column!r} is {event.old_type} in the target and {event.new_type} in this "
                    "batch")
            if options.schema_policy == "evolve" and not castable(event.old_type, event.new_type):
                raise UnrepresentableColumnError(qualified, event.column, f"{what}, which no cast rewrites")
            nested = [t.startswith(("array<", "struct<", "map<")) for t in (event.old_type, event.new_type)]
            if options.schema_policy == "ignore" and (not castable(event.new_type, event.old_type)
                                                      or nested[0] != nested[1]):
                raise CdcApplyError(f"{what}; schema policy 'ignore' would cast the batch's values into the "
                                    f"target's type, which cannot hold them{keep_as_text_hint(qualified, event.column)}"
                                    ", or set schema_policy: evolve")

    def _backfills(self, relation: m.Relation, added: list[ColumnAdded], targets: dict[str, str | None],
                   options: TableOptions, lsn: int) -> list[BackfillTargetColumn]:
        if not added or self.missing_value is None or options.scd_type != 1:
            return []
        backfills = []
        for event in added:
            missing = self.missing_value(relation.oid, event.column)
            column = next(c for c in relation.columns if c.name == event.column)
            if missing.known and missing.text is not None:
                value = self.types.get(column.type_oid).from_text(missing.text, column.typmod)
                backfills.append(BackfillTargetColumn(targets[event.column], event.spark_type, value, lsn))  # type: ignore[arg-type]
            elif missing.generated:
                log.warning("%s.%s: generated column %s is published from now on (publish_generated_columns or a "
                            "column list); rows not changed since keep NULL in the target. To fill them: "
                            "`cdc-apply resync --table %s.%s`", relation.namespace, relation.name, event.column,
                            relation.namespace, relation.name)
            elif not missing.known and missing.has_default:
                log.warning("%s.%s: column %s was added with a default the catalog does not keep (volatile, or the "
                            "table was rewritten since); rows that existed before keep NULL in the target. Delete "
                            "the target to copy the table again.", relation.namespace, relation.name, event.column)
        return backfills
