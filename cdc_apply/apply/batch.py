"""A batch of committed transactions -> per table: schema evolution, collapse, one MERGE.

Invariants:
- Tables are applied one after another; each table's data lands in one Delta commit (plus one
  commit per schema action before it). The caller confirms the slot only after ``apply`` returns.
- Exactly once: a table's commits carry ``txnAppId = <pipeline>/<relation oid>`` and
  ``txnVersion = the batch's last commit LSN``. Rows at or below the version a target already
  holds are dropped before collapse, so a replayed or re-split batch changes nothing twice.
  A Structured Streaming micro-batch (``apply(..., stream_batch=(query id, batch id))``) is
  versioned the same way: its rows are whole transactions in commit order, so a batch Spark runs
  again, or the same changes read again under a new checkpoint, change nothing twice; the query
  and batch ids go into the commit's ``userMetadata``.
- Schema changes are judged against the state stored in the target (``cdc_apply.source``), and
  only for Relation definitions newer than the one that state was made from.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from cdc_apply.apply.collapse import Collapsed, Collapser, MultisetCollapser
from cdc_apply.apply.columnar import CollapsedColumns, collapsed_columns, segment_rows
from cdc_apply.apply.evolve import apply_actions
from cdc_apply.apply.history import HistoryCollapser, merge_history
from cdc_apply.apply.merge import ValueDoesNotFitError, fetch_target_rows, merge_collapsed, new_rows, typed_frame
from cdc_apply.apply.options import ApplyOptions, TableOptions
from cdc_apply.apply.schema import (
    BackfillTargetColumn, ColumnAdded, RenameTargetColumn, RetypeTargetColumn, SourceColumn, describe, diff,
    initial_columns, plan, relation_columns,
)
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.target_state import TargetState, TargetStates
from cdc_apply.apply.targets import KnownVersionAppend, SourceState, Target, TargetRegistry, metadata_columns
from cdc_apply.assemble import Change, SpilledChanges, Transaction
from cdc_apply.changerows.codec import UnrepresentableColumnError
from cdc_apply.changerows.columns import InsertedRows, ParsedImages, ParsedRows
from cdc_apply.changerows.segments import ChangeRowBuilder, TableChanges
from cdc_apply.errors import CdcApplyError
from cdc_apply.failpoints import failpoint
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import TypeCache

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


class TableConfigError(CdcApplyError):
    """A table the apply cannot serve as configured (no usable key, unknown key column)."""


@dataclass
class TableResult:
    table: str
    location: str
    ops: Counter[str] = field(default_factory=Counter)
    keys_written: int = 0
    first_lsn: int | None = None
    last_lsn: int | None = None
    schema_changes: list[str] = field(default_factory=list)
    # source column -> the target column it now feeds, where they differ (a lenient retype's
    # ``d__int``, a case clash): readers find a column's current values there
    side_columns: dict[str, str] = field(default_factory=dict)
    text_columns: list[str] = field(default_factory=list)  # kept as PostgreSQL's text by evolve
    skipped: bool = False  # already applied (exactly once)
    write: str = ""  # how the data was committed: snapshot, append or merge
    columnar: bool = False  # collapsed as Arrow columns (apply/columnar.py), not row by row
    pieces: int = 0  # a spilled transaction appended a piece at a time: how many (0: written whole)
    seconds: float = 0.0


@dataclass(frozen=True)
class Versioning:
    """How a batch's Delta commits are made idempotent (see the module invariants)."""

    version: int  # the batch's last commit LSN: rows at or below a target's version are dropped
    copy_progress: Mapping[str, object] | None = None  # a snapshot chunk: recorded in its own commit
    stream_batch: tuple[str, int] | None = None  # (query id, batch id) of a micro-batch: recorded too


@dataclass
class BatchResult:
    transactions: int
    first_lsn: int | None
    last_lsn: int | None
    tables: list[TableResult]
    seconds: float

    @property
    def changes(self) -> int:
        return sum(sum(t.ops.values()) for t in self.tables if not t.skipped)


@dataclass
class TablePlan:
    """One table in one batch, as decided before any row is collapsed."""

    oid: int
    relation: m.Relation  # the first segment's
    options: TableOptions
    target: Target
    registered: bool
    known: TargetState  # the target's Delta state at the batch's start
    app_id: str
    versioning: Versioning
    snapshot: bool
    lsn_done: int | None  # the pipeline's LSN version: rows at or below it are in the target already
    appendable: bool  # new rows may be appended (see ``_plan``)
    done: bool  # the target holds this batch already (exactly once)

    @property
    def qualified(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"


@dataclass
class CollapsedBatch:
    """One table's batch collapsed: the writer's input."""

    state: SourceState  # the source state after the batch's schema changes
    collapsed: Collapsed  # the states per key; for a columnar collapse only counts and LSNs
    collapser: Collapser | None  # None for a columnar collapse
    columnar: CollapsedColumns | None
    new_rows_only: bool
    appendable: bool


class MissingValue(Protocol):
    """What the backfill needs to know of a column added with a default (``sources.catalog`` gives it)."""

    known: bool  # the catalog still holds the value (not a volatile default, no rewrite since)
    text: str | None  # its text form; None for NULL
    has_default: bool
    generated: bool  # a stored generated column, published from now on


MissingValueLookup = Callable[[int, str], MissingValue]  # (relation OID, column) -> the value


class BatchApplier:
    """Applies batches of committed transactions to Delta targets. One per pipeline run."""

    def __init__(self, spark: SparkSession, options: ApplyOptions, rows: ChangeRowBuilder | None = None,
                 missing_value: MissingValueLookup | None = None) -> None:
        """``missing_value``: the live source's lookup of the value ``ADD COLUMN ... DEFAULT`` gave the
        rows that existed before it, for the backfill (None when there is no live source: replay)."""
        self.spark = spark
        self.missing_value = missing_value
        self._thread_sessions = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self.options = options
        self.rows = rows or ChangeRowBuilder(TypeCache(column_types=self._column_type))
        # (schema, table, source column) kept as PostgreSQL's text because a value did not fit its
        # mapped type under schema_policy: evolve; each target records its own (SourceState.text_columns).
        self.text_columns: set[tuple[str, str, str]] = set()
        self.registry = TargetRegistry(options.warehouse)
        self.target_states = TargetStates()

    def apply(self, transactions: Iterable[Transaction], *, snapshot: bool = False,
              stream_batch: tuple[str, int] | None = None,
              copy_progress: Mapping[str, object] | None = None,
              parsed: ParsedRows | None = None) -> BatchResult:
        """``snapshot``: the transactions are initial-snapshot chunks for tables the caller cleared
        (inserts only, appended; no transaction ids; the caller records the sync point), and
        ``copy_progress`` goes into the chunk's commit metadata (``"copy"``), so a copy cut short
        resumes after it. ``stream_batch``: (query id, batch id) of a Structured Streaming micro-batch.
        ``parsed``: the change rows as their deliverer parsed them already (the data source's rows of a
        micro-batch, a snapshot chunk's COPY values; ``ChangeRowBuilder.build``).

        A transaction that spilled to disk (``SpilledChanges``) is applied on its own, a piece at a
        time where it can be (``_append_in_pieces``), so the driver never holds it whole."""
        transactions = list(transactions)
        if not snapshot and stream_batch is None and parsed is None \
                and any(isinstance(t.changes, SpilledChanges) for t in transactions):
            return self._apply_spilled_apart(transactions)
        return self._apply_together(transactions, snapshot=snapshot, stream_batch=stream_batch,
                                    copy_progress=copy_progress, parsed=parsed)

    def _apply_spilled_apart(self, transactions: list[Transaction]) -> BatchResult:
        """The batch applied in parts: each spilled transaction alone, the runs of others between
        them together. Each part is versioned by its own last commit LSN, as consecutive batches
        are, so a crash between parts repeats nothing (invariant 6)."""
        started = time.perf_counter()
        tables: list[TableResult] = []
        together: list[Transaction] = []
        for txn in [*transactions, None]:
            if txn is not None and not isinstance(txn.changes, SpilledChanges):
                together.append(txn)
                continue
            if together:
                tables += self._apply_together(together).tables
                together = []
            if txn is not None:
                tables += (self._append_in_pieces(txn) or self._apply_together([txn])).tables
        return BatchResult(len(transactions), transactions[0].commit_lsn, transactions[-1].commit_lsn, tables,
                           time.perf_counter() - started)

    def _apply_together(self, transactions: list[Transaction], *, snapshot: bool = False,
                        stream_batch: tuple[str, int] | None = None,
                        copy_progress: Mapping[str, object] | None = None,
                        parsed: ParsedRows | None = None) -> BatchResult:
        """The transactions as one batch: per table, one data commit (``apply``)."""
        started = time.perf_counter()
        if not transactions:
            return BatchResult(0, None, None, [], 0.0)
        version = Versioning(transactions[-1].commit_lsn, copy_progress=copy_progress, stream_batch=stream_batch)
        by_table: dict[int, list[TableChanges]] = {}
        for segment in self.rows.build(transactions, parsed):
            by_table.setdefault(segment.relation.oid, []).append(segment)
        work = list(by_table.items())
        if self.options.parallel_tables > 1 and len(work) > 1:
            results = self._apply_parallel(work, version, snapshot)
        else:
            results = []
            for index, (oid, segments) in enumerate(work):
                if index:
                    failpoint("between_tables")
                results.append(self.apply_table(oid, segments, version, snapshot))
        return BatchResult(len(transactions), transactions[0].commit_lsn, transactions[-1].commit_lsn,
                           [r for r in results if r is not None], time.perf_counter() - started)

    def write_snapshot_chunk(self, relation: m.Relation, rows: ParsedImages, first_row: int, version: int,
                             commit_ts: int, copy_progress: Mapping[str, object] | None) -> BatchResult:
        """A chunk of a table's initial copy (its rows' values as spans: ``inserted_images``), appended
        to the target the caller created or cleared. It carries no transaction id (the caller records
        the sync point once the copy ends); ``copy_progress`` goes into its commit, so a copy cut
        short resumes after it."""
        changes = [Change(first_row + i, "I", relation) for i in range(len(rows.new.present))]
        return self.apply([Transaction(0, version, version, commit_ts, changes, kind="snapshot")], snapshot=True,
                          copy_progress=copy_progress, parsed=InsertedRows(rows))

    def _apply_parallel(self, work: list[tuple[int, list[TableChanges]]], version: Versioning,
                        snapshot: bool) -> list[TableResult | None]:
        """Several tables at once, each thread in its own Spark session: the per-commit confs
        (txnAppId, txnVersion, userMetadata) are session state, so two threads must never share one."""
        if self._pool is None:  # kept for the applier's life, so each thread keeps its session
            self._pool = ThreadPoolExecutor(self.options.parallel_tables, thread_name_prefix="cdc-apply-table")
        futures = [self._pool.submit(self._apply_in_own_session, oid, segments, version, snapshot)
                   for oid, segments in work]
        for index, future in enumerate(as_completed(futures)):
            future.result()
            if index < len(futures) - 1:
                failpoint("between_tables")
        return [future.result() for future in futures]

    def _apply_in_own_session(self, oid: int, segments: list[TableChanges], version: Versioning,
                              snapshot: bool) -> TableResult | None:
        session = getattr(self._thread_sessions, "spark", None)
        if session is None:
            session = self._thread_sessions.spark = self.spark.newSession()
        return self.apply_table(oid, segments, version, snapshot, session)

    def app_id(self, oid: int) -> str:
        return f"{self.options.pipeline}/{oid}"

    def target(self, relation: m.Relation, options: TableOptions,
               spark: SparkSession | None = None) -> tuple[Target, bool]:
        entry = self.registry.get(relation.oid)
        if entry is None:
            location, by_name = ((options.name, True) if options.name is not None
                                 else self.options.default_target(relation.namespace, relation.name))
            return Target(spark or self.spark, location, by_name), False
        return Target(spark or self.spark, entry["location"], entry["by_name"]), True

    def ensure_target(self, relation: m.Relation, position: tuple[int, int]) -> tuple[Target, bool]:
        """The relation's target, created (empty) and registered if needed; True when it existed."""
        options = self.options.for_table(relation.namespace, relation.name)
        target, registered = self.target(relation, options)
        existed = target.exists()
        if not existed:
            self._create(target, relation, options, position)
        if not registered:
            self.registry.add(relation.oid, target.location, target.by_name, relation.namespace, relation.name)
        return target, existed

    def apply_table(self, oid: int, segments: list[TableChanges], versioning: Versioning, snapshot: bool = False,
                    spark: SparkSession | None = None) -> TableResult | None:
        """One table's segments of a batch -> one data commit (and the schema commits before it).

        A value a column's mapped type cannot hold stops the batch, with nothing of it committed,
        except under ``schema_policy: evolve``: the column is switched to PostgreSQL's text (the
        target column rewritten in place) and the table's batch applied again."""
        while True:
            try:
                return self._apply_table(oid, segments, versioning, snapshot, spark)
            except UnrepresentableColumnError as exc:
                segments = self._keep_as_text(segments, exc, spark)

    def _column_type(self, schema: str, table: str, column: str) -> str | None:
        """The type a source column is converted to: the config's, or text where evolve switched it."""
        configured = self.options.column_type(schema, table, column)
        return configured or ("string" if (schema, table, column) in self.text_columns else None)

    def _keep_as_text(self, segments: list[TableChanges], exc: UnrepresentableColumnError,
                      spark: SparkSession | None) -> list[TableChanges]:
        """Under ``evolve``, the failing column from now on as PostgreSQL's text, its target column (if
        any) rewritten to it in its own commit; else ``exc`` again."""
        relation = segments[-1].relation
        options = self.options.for_table(relation.namespace, relation.name)
        column = (relation.namespace, relation.name, exc.column)
        if options.schema_policy != "evolve" or column in self.text_columns:
            raise exc
        self.text_columns.add(column)
        log.warning("%s: column %s switched to PostgreSQL's exact text (schema_policy evolve), since a value does not "
                    "fit its type: %s", exc.table, exc.column, exc)
        target, _ = self.target(relation, options, spark)
        state = self.target_states.current(target).source
        if state is not None:
            columns = [SourceColumn(c.name, "string", c.target) if c.name == exc.column else c for c in state.columns]
            switched = replace(state, columns=columns, text_columns=(*state.text_columns, exc.column))
            retype = [RetypeTargetColumn(c.target, "string") for c in state.columns
                      if c.name == exc.column and c.target is not None]
            apply_actions(target, retype, switched, format_lsn(segments[0].transactions[0].commit_lsn))
            self.target_states.forget(target)
        return self._converted_again(segments)

    def _converted_again(self, segments: list[TableChanges]) -> list[TableChanges]:
        """The segments with codecs built anew, after a column's type changed."""
        self.rows.forget(segments[0].relation.oid)
        return [self.rows.rebuilt(segment) for segment in segments]

    def _apply_table(self, oid: int, segments: list[TableChanges], versioning: Versioning, snapshot: bool,
                     spark: SparkSession | None) -> TableResult | None:
        """The three steps of ``apply_table``: the plan (target, what it holds, how it may be written),
        the collapse (with the schema changes the segments bring) and the writer."""
        started = time.perf_counter()
        plan = self._plan(oid, segments[0].relation, versioning, snapshot, spark)
        if plan is None:
            return None
        known_text = plan.known.source.text_columns if plan.known.source is not None else ()
        learned = {(plan.relation.namespace, plan.relation.name, c) for c in known_text} - self.text_columns
        if learned:  # switched by an earlier run: convert as the target holds them
            self.text_columns |= learned
            segments = self._converted_again(segments)
        result = TableResult(plan.qualified, plan.target.location)
        batch = None if plan.done else self._collapse(plan, segments, result)
        if batch is None:  # the target holds the batch already, or no row is left to apply
            result.skipped = True
            return result
        self._write(plan, batch, result)
        result.seconds = time.perf_counter() - started
        log.info("%s: %s in %.1f s (%s%s)", plan.qualified, dict(result.ops), result.seconds, result.write,
                 ", columnar" if result.columnar else "")
        return result

    def _plan(self, oid: int, relation: m.Relation, versioning: Versioning, snapshot: bool,
              spark: SparkSession | None) -> TablePlan | None:
        """What the target holds and how this batch may be written to it; None for an excluded table."""
        options = self.options.for_table(relation.namespace, relation.name)
        if not options.include:
            return None
        target, registered = self.target(relation, options, spark)
        app_id = self.app_id(oid)
        known = self.target_states.current(target)  # also when the registry was lost: the table holds its state
        writers = known.writers if not snapshot else {}
        done = writers.get(app_id)
        # The target equals the source as of ``done`` when this pipeline alone has written it (or
        # creates it now), so rows it holds are dropped below: then a key whose first change in the
        # batch is an insert is not in it.
        appendable = not snapshot and (not known.exists or set(writers) == {app_id})
        # Rows at or below the pipeline's LSN version (its initial copy, or what ``run`` or
        # ``foreach_batch`` applied) are in the target already, or an insert-only table would get them twice.
        return TablePlan(oid, relation, options, target, registered, known, app_id, versioning, snapshot,
                         lsn_done=done, appendable=appendable,
                         done=done is not None and done >= versioning.version)

    def _collapse(self, plan: TablePlan, segments: list[TableChanges], result: TableResult) -> CollapsedBatch | None:
        """The batch's final state per key, as Arrow columns where ``apply/columnar.py`` can, else row
        by row, after creating or evolving the target for each segment's Relation; None when no row
        is left after those the target holds."""
        state = plan.known.source
        if state is not None and plan.registered and len(segments) == 1:
            columnar = self._columnar_collapse(segments[0], state, plan.options, plan.lsn_done, plan.known.data_types)
            if columnar is not None:  # no Python values on the way
                collapsed = Collapsed(state.keys, op_counts=columnar.op_counts, first_lsn=columnar.first_lsn,
                                      last_lsn=columnar.last_lsn)
                appendable = _appends_new_rows(plan, state)
                return CollapsedBatch(state, collapsed, None, columnar, columnar.new_rows_only, appendable)
        collapser: Collapser | None = None
        backfills: list[BackfillTargetColumn] = []
        appendable = plan.appendable
        for segment in segments:
            rows = segment.rows
            if plan.lsn_done is not None:
                rows = [r for r in rows if r["commit_lsn"] > plan.lsn_done]
            if not rows:
                continue
            state, renamed = self._prepare_target(plan, state, segment, (rows[0]["commit_lsn"], rows[0]["seq"]),
                                                  result, backfills)
            if collapser is None:
                collapser = self._collapser(plan, state)
            else:
                if renamed:
                    collapser.rename_columns(renamed)
                if state.keys != collapser.key_columns:
                    collapser = self._rekeyed(plan, collapser, state)
            column_map = state.column_map()
            identity = all(source == target_name for source, target_name in column_map.items())
            appendable = appendable and _unique_key(segment.relation, column_map, state.keys, plan.options)
            for row in rows:
                collapser.add(row, None if identity else column_map)
        if collapser is None or state is None:
            return None
        collapsed = collapser.result
        for backfill in backfills:  # rows of this batch last changed before the column existed
            for key_state in collapsed.states.values():
                if not key_state.deleted and key_state.commit_lsn < backfill.before_lsn:
                    key_state.values.setdefault(backfill.column, backfill.value)
        return CollapsedBatch(state, collapsed, collapser, None, collapsed.new_rows_only, appendable)

    def _prepare_target(self, plan: TablePlan, state: SourceState | None, segment: TableChanges,
                        position: tuple[int, int], result: TableResult,
                        backfills: list[BackfillTargetColumn]) -> tuple[SourceState, dict[str, str]]:
        """The target ready for a segment's rows: created, registered, or evolved to its Relation.
        Returns the source state after it and the target columns renamed on the way."""
        if state is None:
            state = self._create(plan.target, segment.relation, plan.options, position)
        if not plan.registered:
            relation = plan.relation
            self.registry.add(plan.oid, plan.target.location, plan.target.by_name, relation.namespace, relation.name)
            plan.registered = True
            return state, {}
        return self._evolve(plan.target, state, segment, plan.options, position, result, backfills)

    @staticmethod
    def _collapser(plan: TablePlan, state: SourceState) -> Collapser:
        if plan.options.scd_type == 2:
            return HistoryCollapser(plan.qualified, state.keys)
        if _multiset(state, plan.options):
            return MultisetCollapser(plan.qualified, state.keys)
        return Collapser(plan.qualified, state.keys)

    @staticmethod
    def _rekeyed(plan: TablePlan, collapser: Collapser, state: SourceState) -> Collapser:
        """The batch's collapse so far under the key a Relation inside the batch brought."""
        if not collapser.key_columns or (isinstance(collapser, MultisetCollapser) and _multiset(state, plan.options)):
            collapser.add_key(state.keys)  # an insert-only table got a key, or a whole-row key grew
            return collapser
        states = collapser.result.states
        # The old keys' target rows tell their new keys, unless the old key holds the new one (a
        # whole-row key, a key that shrank); TOAST values a row takes from the target are read too.
        projected = set(state.keys) <= set(collapser.key_columns)
        wanted = {*(s.source_key or key for key, s in states.items() if s.from_target), *(() if projected else states)}
        rows = fetch_target_rows(plan.target, collapser.key_columns, wanted) if plan.known.exists else {}
        log.info("%s: re-keyed from %s to %s inside the batch", plan.qualified, list(collapser.key_columns),
                 list(state.keys))
        return collapser.rekeyed(state.keys, rows)

    def _write(self, plan: TablePlan, batch: CollapsedBatch, result: TableResult) -> None:
        """The batch's one data commit: an append, a MERGE or a history MERGE, idempotent by its
        transaction id; then the target's cached state moves on, or is dropped."""
        state, collapsed, qualified = batch.state, batch.collapsed, plan.qualified
        cached = state is plan.known.source  # no schema commit on the way: the cached types hold
        data_types = plan.known.data_types if cached else plan.target.data_types()
        history = isinstance(batch.collapser, HistoryCollapser)
        # Up to ``merge_until`` the target may hold rows a resumed copy took from a later snapshot
        # than its version says: a first insert there may find its row, so it is merged.
        converged = (collapsed.first_lsn or 0) > state.merge_until
        append = plan.snapshot or (batch.appendable and converged and not history and batch.new_rows_only)
        # A table without a key is insert-only: merge_collapsed appends it whatever ``append`` says.
        write = "snapshot" if plan.snapshot else "append" if append or not state.keys else "merge"
        user_metadata = self._commit_info(plan, state, collapsed, write, result)
        commit_app_id = None if plan.snapshot else plan.app_id
        version = plan.versioning.version
        commit = DataCommit(commit_app_id, version, user_metadata,
                            unwritten_at=plan.known.log_version if cached else None)
        try:
            if history:
                if not state.keys:
                    raise TableConfigError(f"{qualified}: SCD type 2 needs a key; set tables.<name>.keys")
                merge_history(plan.target, batch.collapser, data_types, state.keys, commit)  # type: ignore[arg-type]
            else:
                merge_collapsed(plan.target, collapsed, data_types, state.keys, plan.options, commit, append=append,
                                columnar=batch.columnar)
        except ValueDoesNotFitError as exc:
            source = next((name for name, column in state.column_map().items() if column == exc.column), exc.column)
            raise UnrepresentableColumnError(qualified, source, f"{qualified} (LSN {format_lsn(collapsed.first_lsn or 0)}.."
                                             f"{format_lsn(collapsed.last_lsn or 0)}): {exc}") from None
        self._committed(plan, commit if cached else None)
        result.ops = collapsed.op_counts
        result.keys_written = batch.columnar.keys_written if batch.columnar else len(collapsed.states)
        result.first_lsn, result.last_lsn = collapsed.first_lsn, collapsed.last_lsn
        result.write, result.columnar = write, batch.columnar is not None

    def _commit_info(self, plan: TablePlan, state: SourceState, collapsed: Collapsed, write: str,
                     result: TableResult) -> str:
        """The data commit's ``userMetadata``: how and what it wrote (docs/apply.md); also notes the
        side columns in ``result``."""
        metadata = {"cdc_apply": write, "pipeline": self.options.pipeline, "relation_oid": plan.oid,
                    "source": plan.qualified, "first_lsn": format_lsn(collapsed.first_lsn or 0),
                    "last_lsn": format_lsn(collapsed.last_lsn or 0), "ops": dict(collapsed.op_counts)}
        result.side_columns = {source: column for source, column in state.column_map().items()
                               if column is not None and column != source}
        if result.side_columns:
            metadata["side_columns"] = result.side_columns
        result.text_columns = list(state.text_columns)
        if state.text_columns:
            metadata["text_columns"] = result.text_columns
        if plan.snapshot and plan.versioning.copy_progress is not None:
            metadata["copy"] = dict(plan.versioning.copy_progress)
        if plan.versioning.stream_batch is not None:
            metadata["stream_batch"] = {"query": plan.versioning.stream_batch[0], "batch": plan.versioning.stream_batch[1]}
        if collapsed.truncate is not None:
            metadata["truncate"] = {"lsn": format_lsn(collapsed.truncate.commit_lsn),
                                    "cascade": bool(collapsed.truncate.options & m.TRUNCATE_CASCADE),
                                    "restart_identity": bool(collapsed.truncate.options & m.TRUNCATE_RESTART_IDENTITY)}
        return json.dumps(metadata, sort_keys=True)

    def _committed(self, plan: TablePlan, commit: DataCommit | None) -> None:
        """After the data commit: the target's cached state moves on by ``commit`` (None: created or
        evolved on the way, so the cached types no longer hold), or is dropped to be read again."""
        log_version = (None if commit is None else
                       self.target_states.wrote(plan.target, plan.known, commit.app_id, commit.version,
                                                commit.user_metadata))
        if log_version is None:  # created or evolved on the way, or another commit came between: read again
            self.target_states.forget(plan.target)
        else:
            self._compact_now_and_then(plan.target, plan.known.log_version, log_version)

    def _append_in_pieces(self, txn: Transaction) -> BatchResult | None:
        """A spilled transaction of inserts only, appended to each target a piece at a time (at most
        ``ApplyOptions.piece_bytes`` of messages) and committed once per table (``KnownVersionAppend``):
        the driver holds one piece of it, not all of it. None, with nothing committed, when a table
        needs the whole path: a schema change in the transaction, a MERGE (no unique key, another
        writer, a resumed copy not yet caught up), a new target, SCD type 2, a whole-row key, or
        values the columnar conversion does not take."""
        changes = txn.changes
        assert isinstance(changes, SpilledChanges)
        if changes.ops != {"I"} or len({r.oid for r in changes.relations}) != len(set(changes.relations)):
            return None
        started = time.perf_counter()
        versioning = Versioning(txn.commit_lsn)
        tables: dict[int, _PiecewiseAppend] = {}
        results: list[TableResult] = []
        for relation in changes.relations:
            plan = self._plan(relation.oid, relation, versioning, False, None)
            if plan is None:
                continue
            result = TableResult(plan.qualified, plan.target.location)
            results.append(result)
            if plan.done:
                result.skipped = True
                continue
            table = self._piecewise_append(plan, txn.commit_lsn)
            if table is None:
                return None
            tables[relation.oid] = _PiecewiseAppend(plan, result, table)
        # py4j's Java objects sit in reference cycles, so the JVM lets go of a piece's rows (the plans
        # of its DataFrames hold them) only when Python's cycle collector runs: without a full
        # collection now and then, the pieces of a 1 GB transaction piled up in a 4 GB driver heap
        # until it ran out. One costs about 0.1 s, so it runs every 64 MiB of pieces, not each one.
        collect_every = max(1, 64 * 1024 * 1024 // self.options.piece_bytes)
        for number, piece in enumerate(changes.pieces(self.options.piece_bytes), 1):
            if number % collect_every == 0:
                gc.collect()
            for segment in self.rows.build([replace(txn, changes=piece)]):
                table = tables.get(segment.relation.oid)
                if table is not None and not self._append_piece(table, segment):
                    log.info("%s: transaction at LSN %s takes the whole path (rows the columnar conversion or "
                             "the target's columns do not take); the pieces written are not committed",
                             table.plan.qualified, format_lsn(txn.commit_lsn))
                    return None
        for index, table in enumerate(tables.values()):
            if index:
                failpoint("between_tables")
            self._commit_pieces(table, started)
        return BatchResult(1, txn.commit_lsn, txn.commit_lsn, results, time.perf_counter() - started)

    def _piecewise_append(self, plan: TablePlan, commit_lsn: int) -> KnownVersionAppend | None:
        """The open append of ``plan``'s target for a transaction of inserts only, or None when the
        target needs the whole path (``_append_in_pieces``)."""
        state = plan.known.source
        if state is None or not plan.registered or not self._keyed_as_is(state, plan.relation, plan.options):
            return None
        if state.keys and not _appends_new_rows(plan, state):
            return None
        if commit_lsn <= state.merge_until:
            return None
        return plan.target.open_known_version_append(plan.app_id, plan.known.log_version)

    def _append_piece(self, table: _PiecewiseAppend, segment: TableChanges) -> bool:
        """One piece's rows of one table written into files of its open append (not yet committed)."""
        plan, state = table.plan, table.plan.known.source
        assert state is not None
        rows = segment_rows(segment)
        columns = None if rows is None else collapsed_columns(rows, plan.lsn_done, state.column_map(), state.keys,
                                                              plan.known.data_types)
        if columns is None or not columns.new_rows_only:
            return False
        frame = new_rows(typed_frame(plan.target.spark, columns.columns, plan.known.data_types), plan.options)
        # Arrow batches become partitions: without this a piece would be written as many small files.
        frame = frame.coalesce(plan.target.spark.sparkContext.defaultParallelism)
        if not table.append.write(frame):
            return False
        result = table.result
        result.ops.update(columns.op_counts)
        result.keys_written += columns.keys_written
        result.first_lsn = columns.first_lsn if result.first_lsn is None else result.first_lsn
        result.last_lsn = columns.last_lsn
        result.pieces += 1
        failpoint("between_pieces")
        return True

    def _commit_pieces(self, table: _PiecewiseAppend, started: float) -> None:
        plan, result = table.plan, table.result
        assert plan.known.source is not None
        collapsed = Collapsed(plan.known.source.keys, op_counts=result.ops, first_lsn=result.first_lsn,
                              last_lsn=result.last_lsn)
        user_metadata = self._commit_info(plan, plan.known.source, collapsed, "append", result)
        table.append.commit(plan.versioning.version, user_metadata)
        self._committed(plan, DataCommit(plan.app_id, plan.versioning.version, user_metadata))
        result.write, result.columnar = "append", True
        result.seconds = time.perf_counter() - started
        log.info("%s: %s in %.1f s (append in %d pieces, columnar)", plan.qualified, dict(result.ops),
                 result.seconds, result.pieces)

    def _compact_now_and_then(self, target: Target, before: int, after: int) -> None:
        """OPTIMIZE a target each time its log version passes a multiple of ``optimize_every_commits``,
        so a stream of small commits does not leave ever more small files. It counts the table's
        own versions, so it works the same across restarts and short ``run --once`` runs. A failed
        compaction is only logged: the data is committed, and the next multiple tries again."""
        every = self.options.optimize_every_commits
        if not every or after // every == before // every:
            return
        started = time.perf_counter()
        try:
            target.delta().optimize().executeCompaction()
        except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a committed batch
            log.warning("%s: compaction failed (retried at the next %d commits): %s", target.location, every,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            log.info("%s: compacted small files at version %d in %.1f s", target.location, after,
                     time.perf_counter() - started)
        self.target_states.forget(target)

    def _columnar_collapse(self, segment: TableChanges, state: SourceState, options: TableOptions,
                           lsn_done: int | None, data_types: dict[str, str]) -> CollapsedColumns | None:
        """The segment collapsed as Arrow columns (``apply/columnar.py``), when it brings no schema
        change and the table is applied one row per key (SCD type 1, not a whole-row key); None
        when the row-by-row collapse must take it."""
        if not self._keyed_as_is(state, segment.relation, options):
            return None
        rows = segment_rows(segment)
        return None if rows is None else collapsed_columns(rows, lsn_done, state.column_map(), state.keys, data_types)

    def _keyed_as_is(self, state: SourceState, relation: m.Relation, options: TableOptions) -> bool:
        """One row per key (SCD type 1, not a whole-row key) and no schema change against ``state``
        (else the collapse path evolves the target first)."""
        return options.scd_type == 1 and not _multiset(state, options) \
            and not diff(state.columns, self._columns(relation, options)) \
            and self._later_keys(state, relation, options) == (state.keys, state.whole_row)

    def _columns(self, relation: m.Relation, options: TableOptions) -> list[tuple[str, str]]:
        return [(name, spark_type) for name, spark_type in relation_columns(relation, self.rows.types)
                if options.keeps_column(name)]

    def recreate_target(self, relation: m.Relation, position: tuple[int, int]) -> Target:
        """The relation's target replaced by an empty one with today's schema (a resync's first step)."""
        options = self.options.for_table(relation.namespace, relation.name)
        target, _ = self.target(relation, options)
        self._create(target, relation, options, position, replace=True)
        return target

    def _create(self, target: Target, relation: m.Relation, options: TableOptions,
                position: tuple[int, int], replace: bool = False) -> SourceState:
        current = self._columns(relation, options)
        columns = initial_columns(current, reserved=[name for name, _ in metadata_columns(options)])
        targets = {col.name: col.target for col in columns}
        keys = self._keys(relation, options, set(targets))
        whole_row = relation.replica_identity == "f" and not options.keys
        state = SourceState(relation.oid, relation.namespace, relation.name,
                            tuple(targets[k] for k in keys), columns, position, whole_row=whole_row,  # type: ignore[misc]
                            text_columns=self._text_columns(relation))
        target.create(state, dict(current), options, self.options.table_properties, replace)
        log.info("%s %s for %s.%s (keys %s)", "replaced" if replace else "created", target.location,
                 relation.namespace, relation.name, keys)
        return state

    def _text_columns(self, relation: m.Relation) -> tuple[str, ...]:
        """The relation's columns evolve switched to PostgreSQL's text."""
        return tuple(c.name for c in relation.columns if (relation.namespace, relation.name, c.name) in self.text_columns)

    def _backfills(self, relation: m.Relation, added: list[ColumnAdded], targets: dict[str, str | None],
                   options: TableOptions, lsn: int) -> list[BackfillTargetColumn]:
        if not added or self.missing_value is None or options.scd_type != 1:
            return []
        backfills = []
        for event in added:
            missing = self.missing_value(relation.oid, event.column)
            column = next(c for c in relation.columns if c.name == event.column)
            if missing.known and missing.text is not None:
                value = self.rows.types.get(column.type_oid).from_text(missing.text, column.typmod)
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

    @staticmethod
    def _later_keys(state: SourceState, relation: m.Relation, options: TableOptions) -> tuple[tuple[str, ...], bool]:
        """The target's key under this Relation, and whether it is the whole row (docs/apply.md, "Keys").

        The rows stay the same rows whatever the replica identity, so the target is re-keyed in
        place, never copied again: a unique key stays the key under FULL (the old row carries it);
        a primary key or USING INDEX that the Relation flags becomes the key (the rows are unique on
        it, or PostgreSQL would have refused it), also for an insert-only table (``ADD PRIMARY KEY``);
        a table without a key that turns FULL is keyed by the whole row, which grows with its columns."""
        if options.keys:
            return state.keys, state.whole_row
        targets = state.column_map()
        identity = tuple(targets.get(k) for k in relation.key_columns)
        complete = bool(identity) and None not in identity
        if relation.replica_identity == "f":
            if state.keys and not state.whole_row:
                return state.keys, False
            if state.whole_row and _multiset(state, options):
                return tuple(t for t in identity if t is not None), True
            if not state.keys and complete:
                return identity, True  # type: ignore[return-value]
            return state.keys, state.whole_row
        if relation.replica_identity in ("d", "i") and complete and identity != state.keys:
            log.info("%s.%s: now keyed by %s (replica identity %s): applied by that key from here on",
                     relation.namespace, relation.name, list(identity),
                     m.REPLICA_IDENTITY_NAMES.get(relation.replica_identity, relation.replica_identity))
            return identity, False  # type: ignore[return-value]
        return state.keys, state.whole_row

    @staticmethod
    def _keys(relation: m.Relation, options: TableOptions, columns: set[str]) -> tuple[str, ...]:
        qualified = f"{relation.namespace}.{relation.name}"
        if options.keys:
            missing = [k for k in options.keys if k not in columns]
            if missing:
                raise TableConfigError(f"{qualified}: configured keys {missing} are not columns of the table "
                                       f"(columns: {sorted(columns)})")
            return tuple(options.keys)
        keys = tuple(k for k in relation.key_columns if k in columns)
        if relation.replica_identity == "n":
            return ()  # REPLICA IDENTITY NOTHING: the source allows inserts only
        if not keys and relation.replica_identity == "d":
            # PostgreSQL refuses UPDATE and DELETE on a published table without a replica identity
            # key, so only inserts and truncates can arrive: the table is applied insert-only.
            log.warning("%s: no primary key (replica identity default): applied insert-only, like REPLICA "
                        "IDENTITY NOTHING; a key added later switches it to keyed apply", qualified)
            return ()
        if not keys:
            raise TableConfigError(
                f"{qualified}: no usable key (replica identity "
                f"{m.REPLICA_IDENTITY_NAMES.get(relation.replica_identity, relation.replica_identity)} "
                "without key columns); set tables.<name>.keys in the config or give the table a primary key")
        return keys

    def _evolve(self, target: Target, state: SourceState, segment: TableChanges, options: TableOptions,
                position: tuple[int, int], result: TableResult,
                backfills: list[BackfillTargetColumn]) -> tuple[SourceState, dict[str, str]]:
        """The state after this segment's Relation, and the target columns renamed on the way."""
        if position <= state.applied_at:
            return state, {}
        current = self._columns(segment.relation, options)
        events = diff(state.columns, current)
        if not events:
            keys, whole_row = self._later_keys(state, segment.relation, options)
            if (keys, whole_row) == (state.keys, state.whole_row):
                return state, {}
            keyed = SourceState(state.relation_oid, segment.relation.namespace, segment.relation.name, keys,
                                state.columns, position, state.merge_until, whole_row, state.text_columns)
            apply_actions(target, [], keyed, format_lsn(position[0]))
            return keyed, {}
        where = f"{segment.qualified_name} at LSN {format_lsn(position[0])}"
        data_types = target.data_types()
        text_columns = tuple(dict.fromkeys([*state.text_columns, *self._text_columns(segment.relation)]))
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
        new_state.keys, new_state.whole_row = self._later_keys(new_state, segment.relation, options)
        added = [e for e in events if isinstance(e, ColumnAdded) and targets.get(e.column)]
        backfills += self._backfills(segment.relation, added, targets, options, position[0])
        apply_actions(target, [*decided.actions, *backfills], new_state, format_lsn(position[0]))
        result.schema_changes += [describe(e) for e in events]
        return new_state, renamed


@dataclass
class _PiecewiseAppend:
    """One table's append of a spilled transaction, written a piece at a time (``_append_in_pieces``);
    ``result`` counts what the pieces wrote."""

    plan: TablePlan
    result: TableResult
    append: KnownVersionAppend


def _multiset(state: SourceState, options: TableOptions) -> bool:
    """Keyed by the whole row (REPLICA IDENTITY FULL without a unique key): identical rows may exist, each
    kept (hard deletes, SCD type 1; soft deletes and history keep one row per distinct value, docs/apply.md)."""
    return state.whole_row and not options.keys and options.delete_mode == "hard" and options.scd_type == 1


def _appends_new_rows(plan: TablePlan, state: SourceState) -> bool:
    """New rows of the batch may be appended to the target as ``state`` keys it (see ``_plan``)."""
    return plan.appendable and _unique_key(plan.relation, state.column_map(), state.keys, plan.options)


def _unique_key(relation: m.Relation, column_map: dict[str, str | None], keys: tuple[str, ...],
                options: TableOptions) -> bool:
    """The target's keys are the source's primary key or replica identity index (so unique), and a
    delete removes the row (soft deletes keep keys that PostgreSQL may insert again)."""
    return (relation.replica_identity in ("d", "i") and not options.keys and options.delete_mode != "soft"
            and bool(keys) and tuple(column_map.get(k, k) for k in relation.key_columns) == keys)
