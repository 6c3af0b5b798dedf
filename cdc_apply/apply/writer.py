"""The data port of the apply: one table's collapsed batch written to its Delta target in one
commit (an append, a MERGE, a history MERGE), idempotent by its transaction id, and the target's
cached state moved on after it (docs/architecture.md, the exactly-once invariants).

``BatchApplier`` hands it a ``TablePlan`` and a ``CollapsedBatch`` whose schema the schema
applier (``apply/schema_applier.py``) has already made; the append in pieces
(``apply/pieces.py``) commits through ``commit_info`` and ``committed`` too.
"""

from __future__ import annotations

import json
import logging
import time

from cdc_apply.apply.collapse import Collapsed
from cdc_apply.apply.history import HistoryCollapser, merge_history
from cdc_apply.apply.merge import ValueDoesNotFitError, merge_collapsed
from cdc_apply.apply.options import ApplyOptions
from cdc_apply.apply.plan import CollapsedBatch, TableConfigError, TablePlan, TableResult
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.target_state import TargetStates
from cdc_apply.apply.targets import SourceState, Target
from cdc_apply.changerows.codec import UnrepresentableColumnError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m

log = logging.getLogger(__name__)


class TableWriter:
    def __init__(self, options: ApplyOptions, target_states: TargetStates) -> None:
        self.options = options
        self.target_states = target_states

    def write(self, plan: TablePlan, batch: CollapsedBatch, result: TableResult) -> None:
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
        user_metadata = self.commit_info(plan, state, collapsed, write, result)
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
                                columnar=batch.columnar, frame=batch.frame)
        except ValueDoesNotFitError as exc:
            source = next((name for name, column in state.column_map().items() if column == exc.column), exc.column)
            raise UnrepresentableColumnError(qualified, source, f"{qualified} (LSN {format_lsn(collapsed.first_lsn or 0)}.."
                                             f"{format_lsn(collapsed.last_lsn or 0)}): {exc}") from None
        self.committed(plan, commit if cached else None)
        result.ops = collapsed.op_counts
        result.keys_written = batch.columnar.keys_written if batch.columnar else len(collapsed.states)  # 0: a frame
        result.first_lsn, result.last_lsn = collapsed.first_lsn, collapsed.last_lsn
        result.write, result.columnar = write, batch.columnar is not None

    def commit_info(self, plan: TablePlan, state: SourceState, collapsed: Collapsed, write: str,
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

    def committed(self, plan: TablePlan, commit: DataCommit | None) -> None:
        """After the data commit: the target's cached state moves on by ``commit`` (None: created or
        evolved on the way, so the cached types no longer hold), or is dropped to be read again."""
        log_version = (None if commit is None else
                       self.target_states.wrote(plan.target, plan.known, commit.app_id, commit.version,
                                                commit.user_metadata))
        if log_version is None:  # created or evolved on the way, or another commit came between: read again
            self.target_states.forget(plan.target)
        else:
            self._compact_now_and_then(plan.target, plan.known.log_version, log_version)

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
            target.compact()
        except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a committed batch
            log.warning("%s: compaction failed (retried at the next %d commits): %s", target.location, every,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            log.info("%s: compacted small files at version %d in %.1f s", target.location, after,
                     time.perf_counter() - started)
        self.target_states.forget(target)
