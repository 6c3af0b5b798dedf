"""A pipeline's parts for one config, built in one place: the targets' applier, the copier of new
tables, the change log and the sink the replication loop writes to (the composition root). Every
runner asks here: `run --once` and `run --follow`, `stream`, `resync`, `follow-changelog`, the
copy's bench (docs/architecture.md, "Modules").

The parts below stand apart and are handed each other here: ``sink.DeltaSink`` asks for a copier
and a change log by their ports (``sink.NewTableCopier``, ``sink.ChangeLogAppender``), and a
``BatchApplier`` for the source's ADD COLUMN ... DEFAULT lookup, so none of them imports a part
above it (docs/architecture.md, "Import rules").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_apply.apply.batch import BatchApplier, BatchResult
from cdc_apply.apply.options import apply_options
from cdc_apply.changelog.applier import ChangeLogApplier
from cdc_apply.changelog.follower import TargetFollower
from cdc_apply.changelog.log import ChangeLog, enabled_changelog
from cdc_apply.config import BatchingConfig, Config
from cdc_apply.lake.state import AppliedPosition
from cdc_apply.sink import DeltaSink, RunSummary
from cdc_apply.snapshot.copier import Snapshotter
from cdc_apply.sources.catalog import SourceCatalog
from cdc_apply.transactions import Transaction

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def source_applier(config: Config, spark: SparkSession) -> BatchApplier:
    """The targets' applier of a pipeline with a live source: an ``ADD COLUMN ... DEFAULT`` backfill
    asks the source's catalog for the value earlier rows have."""
    return BatchApplier(spark, apply_options(config), missing_value=SourceCatalog.of(config.source).missing_value)


def copier(config: Config, spark: SparkSession, applier: BatchApplier | None = None,
           changelog: ChangeLog | None = None) -> Snapshotter:
    """The copier of the config's tables (initial copies, resyncs), committing through ``applier``
    (by default a ``source_applier``) and telling ``changelog`` (by default the config's, when on)
    of each copy."""
    return Snapshotter(config.source, config.snapshot, applier or source_applier(config, spark),
                       changelog or enabled_changelog(spark, config))


@dataclass
class RunParts:
    """What a run writes through: ``sink`` (the replication loop's), with its applier and the copier
    of the config's tables (``snapshotter``: the run's initial copies; the sink's too, when it copies
    the tables it meets without a target).

    Under ``changelog.confirm_after: changelog`` with ``targets: in_process``, the batches only go to
    the change log, and ``from_log`` brings the targets up from it: as ``follower``, a thread the
    caller starts once the targets are copied (after ``changelog.ensure()``) and stops, or at the
    end of a bounded run (``from_log.catch_up()``) when built without one."""

    applier: BatchApplier
    snapshotter: Snapshotter
    sink: DeltaSink
    summary: RunSummary
    from_log: ChangeLogApplier | None = None
    follower: TargetFollower | None = None


def run_parts(config: Config, spark: SparkSession, summary: RunSummary, *, sink_copies: bool = True,
              follower: bool = True) -> RunParts:
    """The parts of a run of ``config``. ``sink_copies``: the sink copies a table it meets without a
    target (one added to the publication later), as `run` does; `stream`'s data source copies them
    itself. ``follower``: under ``confirm_after: changelog`` with ``targets: in_process``, a follower
    thread rather than a catch-up at the end."""
    changelog = enabled_changelog(spark, config)
    applier = source_applier(config, spark)
    snapshotter = copier(config, spark, applier, changelog)
    from_log = None
    if changelog is not None and config.changelog.follower == "in_process":
        from_log = targets_from_changelog(changelog, applier, summary, config.batching)
    large_transactions_from_changelog(changelog, applier, config)
    thread = TargetFollower(from_log) if follower and from_log is not None else None
    told: Callable[[list[Transaction]], None] | None = None
    if thread is not None:
        told = thread.logged
    elif from_log is not None or config.changelog.follower == "separate":
        # The batch is durable once the log holds it: a bounded run's catch-up at its end, or
        # `cdc-apply follow-changelog` (``changelog.targets: separate``), applies it to the targets.
        told = _targets_take_it_from_the_log
    sink = DeltaSink(applier, summary, snapshotter if sink_copies else None, changelog, told)
    return RunParts(applier, snapshotter, sink, summary, from_log, thread)


def _targets_take_it_from_the_log(batch: list[Transaction]) -> None:
    """The batch is in the change log; the targets take it from there later."""


def large_transactions_from_changelog(changelog: ChangeLog | None, applier: BatchApplier, config: Config) -> None:
    """With the log on and ``confirm_after: targets``, the stream's spilled transactions that update or
    delete are collapsed by Spark from the log, which holds them before the targets are written
    (``ChangeLogApplier.apply_on_executors``), instead of whole on the driver."""
    if changelog is not None and config.changelog.follower is None:
        applier.large_transactions = ChangeLogApplier(changelog, applier, max_changes=config.batching.max_changes,
                                                      spill_bytes=config.batching.spill_bytes).apply_on_executors


def targets_from_changelog(changelog: ChangeLog, stream_applier: BatchApplier, summary: RunSummary,
                           batching: BatchingConfig) -> ChangeLogApplier:
    """The applier that brings ``stream_applier``'s targets up to date from ``changelog`` under
    ``confirm_after: changelog``, in a Spark session of its own; each window it applies is recorded
    in ``summary`` (commit -> target lag) and its metrics."""
    def applied(result: BatchResult, transactions: list[Transaction]) -> None:
        summary.record(result, transactions)
        if summary.metrics is not None and result.last_lsn is not None:
            summary.metrics.targets_applied(result.last_lsn)

    return ChangeLogApplier(changelog, stream_applier.in_new_session(), max_changes=batching.max_changes,
                            position=AppliedPosition(stream_applier.options.state),
                            applied=applied, spill_bytes=batching.spill_bytes)
