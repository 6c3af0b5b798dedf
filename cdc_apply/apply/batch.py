"""A batch of committed transactions -> per table: schema evolution, collapse, one MERGE.

The steps, each in its own module: the plan of a table's batch (``apply/plan.py``), the schema
port that creates and evolves targets (``apply/schema_applier.py``), the collapse chosen here
(as Arrow columns, ``apply/columnar.py``, or row by row, ``apply/collapse.py``), the data writer
(``apply/writer.py``), and the append in pieces of a spilled transaction (``apply/pieces.py``).

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

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from typing import TYPE_CHECKING

from cdc_apply.apply.collapse import Collapsed, Collapser, MultisetCollapser
from cdc_apply.apply.columnar import CollapsedColumns, collapsed_columns, segment_rows
from cdc_apply.apply.history import HistoryCollapser
from cdc_apply.apply.merge import fetch_target_rows
from cdc_apply.apply.options import ApplyOptions, TableOptions
from cdc_apply.apply.pieces import PiecewiseAppender
from cdc_apply.apply.plan import (
    BatchResult, CollapsedBatch, ExternalCollapse, MissingValue, MissingValueLookup, TablePlan, TableResult, Versioning,
    appends_new_rows, multiset, unique_key,
)
from cdc_apply.apply.schema import BackfillTargetColumn
from cdc_apply.apply.schema_applier import SchemaApplier
from cdc_apply.apply.session_kind import new_session
from cdc_apply.apply.target_state import TargetStates
from cdc_apply.apply.targets import SourceState, Target, target_at
from cdc_apply.lake.state import TargetRegistry
from cdc_apply.apply.writer import TableWriter
from cdc_apply.transactions import Change, SpilledChanges, Transaction
from cdc_apply.changerows.codec import PortableCodec, UnrepresentableColumnError
from cdc_apply.changerows.columns import InsertedRows, ParsedImages, ParsedRows
from cdc_apply.changerows.segments import ChangeRowBuilder, TableChanges
from cdc_apply.failpoints import failpoint
from cdc_apply.pgoutput import messages as m

__all__ = ["BatchApplier", "BatchResult", "MissingValue", "MissingValueLookup", "TableResult"]

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


# Delta's error when a commit recording a writer identity's version finds another commit of it first.
CONCURRENT_TRANSACTION = "DELTA_CONCURRENT_TRANSACTION"
MAX_OWN_CONFLICTS = 30


class BatchApplier:
    """Applies batches of committed transactions to Delta targets. One per pipeline run."""

    def __init__(self, spark: SparkSession, options: ApplyOptions,
                 missing_value: MissingValueLookup | None = None, registry: TargetRegistry | None = None) -> None:
        """``missing_value``: see ``SchemaApplier``, which backfills added columns with it.
        ``registry``: another applier's, when two write the same warehouse at once."""
        self.spark = spark
        self._thread_sessions = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self.options = options
        self.missing_value = missing_value
        self.target_states = TargetStates()
        self.schema = SchemaApplier(options, self.target_states, missing_value)
        self.rows = ChangeRowBuilder(self.schema.types)  # the same type cache: Type messages register there
        self.writer = TableWriter(options, self.target_states)
        # A spilled transaction the pieces do not take is offered here before the driver collapses it
        # whole: the change log's collapse by Spark (``parts.large_transactions_from_changelog``).
        self.large_transactions: Callable[[Transaction], BatchResult | None] | None = None
        self.pieces = PiecewiseAppender(lambda oid, relation, versioning: self._plan(oid, relation, versioning, False, None),
                                        self.rows, self.schema, self.writer, options.piece_bytes)
        self.registry = registry or TargetRegistry(options.state)

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
        time where it can be (``apply/pieces.py``), so the driver never holds it whole."""
        transactions = list(transactions)
        if not snapshot and stream_batch is None and parsed is None \
                and any(isinstance(t.changes, SpilledChanges) for t in transactions):
            return self._apply_spilled_apart(transactions)
        return self._apply_together(transactions, snapshot=snapshot, stream_batch=stream_batch,
                                    copy_progress=copy_progress, parsed=parsed)

    def in_new_session(self) -> BatchApplier:
        """An applier of the same targets in a Spark session of its own (the per-commit confs are
        session state), for another thread that writes them."""
        return BatchApplier(new_session(self.spark), self.options, self.missing_value, self.registry)

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
                offered = self.large_transactions
                tables += (self.pieces.append(txn) or (offered(txn) if offered is not None else None)
                           or self._apply_together([txn])).tables
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
        try:
            for index, future in enumerate(as_completed(futures)):
                future.result()
                if index < len(futures) - 1:
                    failpoint("between_tables")
        finally:
            # A table's failure goes up only once the others ended: a batch tried again (run --follow
            # after a failed write) must not commit beside what is left of its first try.
            wait(futures)
        return [future.result() for future in futures]

    def _apply_in_own_session(self, oid: int, segments: list[TableChanges], version: Versioning,
                              snapshot: bool) -> TableResult | None:
        session = getattr(self._thread_sessions, "spark", None)
        if session is None:
            session = self._thread_sessions.spark = new_session(self.spark)
        return self.apply_table(oid, segments, version, snapshot, session)

    def app_id(self, oid: int) -> str:
        return f"{self.options.pipeline}/{oid}"

    def target(self, relation: m.Relation, options: TableOptions,
               spark: SparkSession | None = None) -> tuple[Target, bool]:
        entry = self.registry.get(relation.oid)
        if entry is None:
            location, by_name = ((options.name, True) if options.name is not None
                                 else self.options.default_target(relation.namespace, relation.name))
            return target_at(spark or self.spark, self.options, location, by_name), False
        return target_at(spark or self.spark, self.options, entry["location"], entry["by_name"]), True

    def ensure_target(self, relation: m.Relation, position: tuple[int, int]) -> tuple[Target, bool]:
        """The relation's target, created (empty) and registered if needed; True when it existed."""
        options = self.options.for_table(relation.namespace, relation.name)
        target, registered = self.target(relation, options)
        existed = target.exists()
        if not existed:
            self.schema.create(target, relation, options, position)
        if not registered:
            self.registry.add(relation.oid, target.location, target.by_name, relation.namespace, relation.name)
        return target, existed

    def apply_table(self, oid: int, segments: list[TableChanges], versioning: Versioning, snapshot: bool = False,
                    spark: SparkSession | None = None) -> TableResult | None:
        """One table's segments of a batch -> one data commit (and the schema commits before it).

        A value a column's mapped type cannot hold stops the batch, with nothing of it committed,
        except under ``schema_policy: evolve``: the column is switched to PostgreSQL's text (the
        target column rewritten in place) and the table's batch applied again.

        A commit refused because another commit of this writer identity came first is planned again
        from the table's log: on Spark Connect, a client killed mid-commit leaves its commit running
        on the server, and the restarted client's one then finds it (docs/spark.md, "Spark Connect")."""
        conflicts = 0
        while True:
            try:
                return self._apply_table(oid, segments, versioning, snapshot, spark)
            except UnrepresentableColumnError as exc:
                relation = segments[-1].relation
                target, _ = self.target(relation, self.options.for_table(relation.namespace, relation.name), spark)
                self.schema.keep_as_text(target, relation, exc, segments[0].transactions[0].commit_lsn)
                segments = self._converted_again(segments)
            except Exception as exc:
                if CONCURRENT_TRANSACTION not in str(exc) or conflicts >= MAX_OWN_CONFLICTS:
                    raise
                conflicts += 1
                relation = segments[-1].relation
                target, _ = self.target(relation, self.options.for_table(relation.namespace, relation.name), spark)
                log.warning("%s: another commit of this pipeline's writer identity came first (%s); the table's "
                            "log is read again", target.location, CONCURRENT_TRANSACTION)
                self.target_states.forget(target)
                time.sleep(min(conflicts, 5))

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
        if self._learn_text_columns(plan):
            segments = self._converted_again(segments)
        result = TableResult(plan.qualified, plan.target.location)
        batch = None if plan.done else self._collapse(plan, segments, result)
        if batch is None:  # the target holds the batch already, or no row is left to apply
            result.skipped = True
            return result
        self.writer.write(plan, batch, result)
        result.seconds = time.perf_counter() - started
        log.info("%s: %s in %.1f s (%s%s)", plan.qualified, dict(result.ops), result.seconds, result.write,
                 ", columnar" if result.columnar else "")
        return result

    def _learn_text_columns(self, plan: TablePlan) -> bool:
        """True when the target holds columns an earlier run switched to text that this applier did not
        know of: they are converted as the target holds them from now on (the codecs are built again)."""
        known_text = plan.known.source.text_columns if plan.known.source is not None else ()
        learned = {(plan.relation.namespace, plan.relation.name, c) for c in known_text} - self.schema.text_columns
        self.schema.text_columns |= learned
        return bool(learned)

    def apply_table_collapsed_by(self, relation: m.Relation, versioning: Versioning, collapse: ExternalCollapse,
                                 op_counts: Counter[str], first_lsn: int, last_lsn: int) -> TableResult | None:
        """One table's changes of a batch, of one Relation definition and no truncate, collapsed by
        ``collapse`` (on Spark's executors: ``changelog/log_collapse.py``) and written by the same writer in
        one commit with the same version, so the driver holds none of its rows. None when the driver's
        collapse must take the batch: a new target, a Relation that changes the target's schema or key,
        a table not applied one row per key (history, a whole-row key, no key). A table the config
        excludes, or one whose target holds the batch already, gives a skipped result."""
        started = time.perf_counter()
        plan = self._plan(relation.oid, relation, versioning, False, None)
        if plan is None or plan.done:
            qualified = f"{relation.namespace}.{relation.name}"
            return TableResult(qualified, plan.target.location if plan else "", skipped=True)
        state = plan.known.source
        if state is None or not plan.registered or not state.keys \
                or not self.schema.keyed_as_is(state, relation, plan.options):
            return None
        if self._learn_text_columns(plan):
            self.rows.forget(relation.oid)  # a codec cached before is stale, or the driver's next batch would use it
        result = TableResult(plan.qualified, plan.target.location)
        codec = PortableCodec(relation, self.schema.exact_text_columns(relation, state), dict(self.schema.types.named))
        frame = collapse(codec, state.column_map(), state.keys, dict(plan.known.data_types),
                         plan.lsn_done)
        collapsed = Collapsed(state.keys, op_counts=op_counts, first_lsn=first_lsn, last_lsn=last_lsn)
        self.writer.write(plan, CollapsedBatch(state, collapsed, None, None, False, False, frame), result)
        result.seconds = time.perf_counter() - started
        log.info("%s: %s in %.1f s (%s, collapsed by Spark)", plan.qualified, dict(op_counts), result.seconds,
                 result.write)
        return result

    def _plan(self, oid: int, relation: m.Relation, versioning: Versioning, snapshot: bool,
              spark: SparkSession | None) -> TablePlan | None:
        """What the target holds and how this batch may be written to it; None for an excluded table."""
        options = self.options.for_table(relation.namespace, relation.name)
        if not options.include:
            return None
        target, registered = self.target(relation, options, spark)
        app_id = self.app_id(oid)
        target.fence(app_id)  # a Connect session's first touch: a killed client's commit cannot land later
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
                appendable = appends_new_rows(plan, state)
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
            appendable = appendable and unique_key(segment.relation, column_map, state.keys, plan.options)
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
            state = self.schema.create(plan.target, segment.relation, plan.options, position)
        if not plan.registered:
            relation = plan.relation
            self.registry.add(plan.oid, plan.target.location, plan.target.by_name, relation.namespace, relation.name)
            plan.registered = True
            return state, {}
        return self.schema.evolve(plan.target, state, segment, plan.options, position, result, backfills)

    @staticmethod
    def _collapser(plan: TablePlan, state: SourceState) -> Collapser:
        if plan.options.scd_type == 2:
            return HistoryCollapser(plan.qualified, state.keys)
        if multiset(state, plan.options):
            return MultisetCollapser(plan.qualified, state.keys)
        return Collapser(plan.qualified, state.keys)

    @staticmethod
    def _rekeyed(plan: TablePlan, collapser: Collapser, state: SourceState) -> Collapser:
        """The batch's collapse so far under the key a Relation inside the batch brought."""
        if not collapser.key_columns or (isinstance(collapser, MultisetCollapser) and multiset(state, plan.options)):
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

    def _columnar_collapse(self, segment: TableChanges, state: SourceState, options: TableOptions,
                           lsn_done: int | None, data_types: dict[str, str]) -> CollapsedColumns | None:
        """The segment collapsed as Arrow columns (``apply/columnar.py``), when it brings no schema
        change and the table is applied one row per key (SCD type 1, not a whole-row key); None
        when the row-by-row collapse must take it."""
        if not self.schema.keyed_as_is(state, segment.relation, options):
            return None
        rows = segment_rows(segment)
        return None if rows is None else collapsed_columns(rows, lsn_done, state.column_map(), state.keys, data_types)

    def recreate_target(self, relation: m.Relation, position: tuple[int, int]) -> Target:
        """The relation's target replaced by an empty one with today's schema (a resync's first step)."""
        options = self.options.for_table(relation.namespace, relation.name)
        target, _ = self.target(relation, options)
        self.schema.create(target, relation, options, position, replace=True)
        return target
