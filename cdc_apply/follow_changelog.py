"""``cdc-apply follow-changelog``: the targets kept current from the change log by a Structured
Streaming query, ``readStream.format("delta")`` on the log -> ``foreachBatch`` (docs/change-log-table.md,
"The targets as a separate job"). This is the bronze -> silver pipeline run by Spark: the ``run``
process (``changelog.targets: separate``) only copies new tables and appends to the log, and
confirms the slot at the log's commit.

Each micro-batch says how far the log has grown: its largest commit LSN. The batch's own rows are
not applied; ``ChangeLogApplier.catch_up`` reads the log up to that LSN in windows of whole
transactions from the targets' recorded position. That makes a micro-batch's cut irrelevant: Delta's
streaming source may split one append's files over two micro-batches, but the log's commit holds the
whole transaction, and the first micro-batch that sees any of it applies all of it.

Invariants:
- The targets' exactly-once versions are the log's commit LSNs, as for the in-process follower: a
  micro-batch run again after a crash, or a new checkpoint that starts from the whole log, applies
  nothing a target holds.
- Only one writer brings the targets up from the log: this query refuses a config whose ``run``
  does it itself (``changelog.targets: in_process``).
- The log's trims (``trim-changelog``, a DELETE) are not changes to follow: the query skips them
  (``skipChangeCommits``); a target that needs trimmed rows is refused by ``catch_up``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cdc_apply.apply.session_kind import is_connect, new_session
from cdc_apply.apply.options import apply_options
from cdc_apply.changelog.log import ChangeLog
from cdc_apply.changelog.applier import ChangeLogApplier
from cdc_apply.lake.state import AppliedPosition
from cdc_apply.config import Config, ConfigError
from cdc_apply.lake.location import path_component
from cdc_apply.lsn import format_lsn
from cdc_apply.parts import source_applier
from cdc_apply.sink import RunSummary
from cdc_apply.changelog.log_files import COPY_XID
from cdc_apply.runtime import StopFlag, await_query

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

log = logging.getLogger(__name__)


def changelog_checkpoint(config: Config) -> str:
    """``<warehouse>/_cdc_apply/changelog_checkpoints/<pipeline>``: beside the targets' recorded position,
    apart from ``cdc-apply stream``'s checkpoints."""
    return str(apply_options(config).state.location("changelog_checkpoints", path_component(config.pipeline)))


def _refuse_in_process(config: Config) -> None:
    if config.changelog.follower != "separate":
        raise ConfigError("changelog.targets: cdc-apply follow-changelog brings the targets up from the change log "
                          "only when the pipeline's run leaves that to it (changelog.enabled: true, confirm_after: "
                          "changelog, targets: separate); two writers would fight over the targets' commits")


def _from_log(config: Config, session: SparkSession, summary: RunSummary) -> ChangeLogApplier:
    changelog = ChangeLog(session, config)
    changelog.ensure()
    return ChangeLogApplier(changelog, source_applier(config, session), max_changes=config.batching.max_changes,
                            position=AppliedPosition(apply_options(config).state),
                            applied=lambda result, transactions: summary.record(result, transactions),
                            spill_bytes=config.batching.spill_bytes)


def start_changelog_stream(config: Config, spark: SparkSession, *, once: bool = False) -> StreamingQuery:
    """The query that applies the change log to the targets, in a Spark session of its own (a Delta
    commit's ``txnAppId`` is session state: a caller's own writes on the same session would mix with
    the query's). ``once``: everything the log holds now, then the query ends (``availableNow``);
    else a trigger every ``stream.interval_seconds``. ``query.summary`` (a ``RunSummary``) counts
    the windows applied and their commit -> target lag. A classic session only: on Connect the
    ``foreachBatch`` function runs in the server's Python worker (``follow_changelog``)."""
    _refuse_in_process(config)
    session = new_session(spark)
    summary = RunSummary()
    from_log = _from_log(config, session, summary)

    def apply_micro_batch(frame: DataFrame, batch_id: int) -> None:
        # A copy's rows (xid 0) are not the log's growth: they may be a copy under way, whose target
        # the copy writes itself.
        grown_to = frame.where(frame["xid"] != COPY_XID).agg({"commit_lsn": "max"}).collect()[0][0]
        if grown_to is None:
            return
        results = from_log.catch_up(until=grown_to)
        log.info("change log micro-batch %d: the targets hold the log up to %s (%d window(s) applied)", batch_id,
                 format_lsn(grown_to), len(results))

    target = from_log.changelog.target
    reader = session.readStream.format("delta").option("skipChangeCommits", "true")
    frame = reader.table(target.location) if target.by_name else reader.load(target.location)
    writer = (frame.select("commit_lsn", "xid").writeStream.foreachBatch(apply_micro_batch)
              .queryName(f"{config.pipeline}/changelog").option("checkpointLocation", changelog_checkpoint(config)))
    writer = writer.trigger(availableNow=True) if once else \
        writer.trigger(processingTime=f"{config.stream.interval_seconds} seconds")
    query = writer.start()
    query.summary = summary  # type: ignore[attr-defined]
    log.info("following the change log %s into the targets of %s (query id %s, checkpoint %s)", target.location,
             config.target.warehouse, query.id, changelog_checkpoint(config))
    return query


def follow_changelog(config: Config, spark: SparkSession, stop: StopFlag, *, once: bool = False) -> RunSummary:
    """`cdc-apply follow-changelog`: until ``stop`` (or, ``once``, until the targets hold what the log
    holds now). On a classic session, the Structured Streaming query (``start_changelog_stream``).
    On Spark Connect a ``foreachBatch`` function runs in the server's Python worker, which cannot
    hold this process's applier; there the same catch-up is driven from here every
    ``stream.interval_seconds``, each round up to the log's batches' version (the last commit LSN
    the run appended, read from the log's files: copies commit without it). The exactly-once
    versions are the same log commit LSNs, so either way of following may take over from the other."""
    if not is_connect(spark):
        query = start_changelog_stream(config, spark, once=once)
        try:
            await_query(query, stop)
        finally:
            if query.isActive:
                query.stop()
        return query.summary  # type: ignore[attr-defined,no-any-return]
    _refuse_in_process(config)
    summary = RunSummary()
    from_log = _from_log(config, new_session(spark), summary)
    changelog = from_log.changelog
    log.info("following the change log %s into the targets of %s from this Connect client, every %g s",
             changelog.target.location, config.target.warehouse, config.stream.interval_seconds)
    while True:
        grown_to = changelog.target.committed_version(changelog.app_id)
        if grown_to is not None:
            from_log.catch_up(until=grown_to, stopping=stop.event)
        if once or stop.event.wait(config.stream.interval_seconds):
            return summary
