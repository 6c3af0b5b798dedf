"""A spilled transaction of inserts only, appended a piece at a time (invariant 15 in
docs/architecture.md): the driver holds one piece of it, never all of it, and each table still
gets one Delta commit with the transaction's version (``KnownVersionAppend``).

``BatchApplier`` splits a batch around its spilled transactions and offers each one here first;
``append`` returns None, with nothing committed, when a table needs the whole path.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from cdc_apply.apply.session_kind import default_parallelism
from cdc_apply.apply.collapse import Collapsed
from cdc_apply.apply.columnar import collapsed_columns, segment_rows
from cdc_apply.apply.merge import new_rows, typed_frame
from cdc_apply.apply.staging import staging_scope
from cdc_apply.apply.plan import BatchResult, TablePlan, TableResult, Versioning, appends_new_rows
from cdc_apply.apply.schema_applier import SchemaApplier
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.delta_internal import KnownVersionAppend
from cdc_apply.apply.writer import TableWriter
from cdc_apply.transactions import SpilledChanges, Transaction
from cdc_apply.changerows.segments import ChangeRowBuilder, TableChanges
from cdc_apply.failpoints import failpoint
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m

log = logging.getLogger(__name__)

Planner = Callable[[int, m.Relation, Versioning], "TablePlan | None"]  # BatchApplier's plan of a table


@dataclass
class _PiecewiseAppend:
    """One table's append of a spilled transaction, written a piece at a time (``PiecewiseAppender``);
    ``result`` counts what the pieces wrote."""

    plan: TablePlan
    result: TableResult
    append: KnownVersionAppend


class PiecewiseAppender:
    def __init__(self, planner: Planner, rows: ChangeRowBuilder, schema: SchemaApplier, writer: TableWriter,
                 piece_bytes: int) -> None:
        self.planner = planner
        self.rows = rows
        self.schema = schema
        self.writer = writer
        self.piece_bytes = piece_bytes

    def append(self, txn: Transaction) -> BatchResult | None:
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
            plan = self.planner(relation.oid, relation, versioning)
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
        collect_every = max(1, 64 * 1024 * 1024 // self.piece_bytes)
        for number, piece in enumerate(changes.pieces(self.piece_bytes), 1):
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
        target needs the whole path (``append``)."""
        state = plan.known.source
        if state is None or not plan.registered or not self.schema.keyed_as_is(state, plan.relation, plan.options):
            return None
        if state.keys and not appends_new_rows(plan, state):
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
        with staging_scope():  # the piece's files are written when ``write`` returns
            frame = new_rows(typed_frame(plan.target.spark, columns.columns, plan.known.data_types,
                                         plan.target.staging), plan.options)
            # Arrow batches become partitions: without this a piece would be written as many small files.
            frame = frame.coalesce(default_parallelism(plan.target.spark))
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
        user_metadata = self.writer.commit_info(plan, plan.known.source, collapsed, "append", result)
        table.append.commit(plan.versioning.version, user_metadata)
        self.writer.committed(plan, DataCommit(plan.app_id, plan.versioning.version, user_metadata))
        result.write, result.columnar = "append", True
        result.seconds = time.perf_counter() - started
        log.info("%s: %s in %.1f s (append in %d pieces, columnar)", plan.qualified, dict(result.ops),
                 result.seconds, result.pieces)
