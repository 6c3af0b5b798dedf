"""`cdc-apply replay`: capture files, or the change log, -> committed transactions -> Delta targets.

From capture files: the replication core (``cdc_apply.replication``) over files, with nothing to
confirm: decode, assemble, cut batches at transaction boundaries, apply each batch.

From the change log (``replay_changelog``, ``--changelog``): its rows, in windows of whole
transactions, turned back into transactions as ``foreach_batch`` turns a micro-batch
(``spark.foreach.micro_batch_changes``: the Relation in force and the message bytes each row
holds), and applied by the same ``BatchApplier`` with the same per-table versions as the run that
wrote them. Either way, replaying twice changes nothing (exactly-once versions).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from cdc_apply.apply.batch import BatchApplier, BatchResult, MissingValue, MissingValueLookup
from cdc_apply.apply.options import ApplyOptions
from cdc_apply.apply.targets import target_at
from cdc_apply.lake.state import TargetRegistry
from cdc_apply.changelog.log import ChangeLog, ChangeLogError, RecordedCopy
from cdc_apply.changelog.applier import ChangeLogApplier
from cdc_apply.config import Config
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.progress import progress
from cdc_apply.replication import BatchCut, ReplicationCore
from cdc_apply.sink import DeltaSink, RunSummary
from cdc_apply.sources.capture import read_captures
from cdc_apply.sources.catalog import MissingValue as SourceMissingValue, SourceCatalog

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


def replay(spark: SparkSession, paths: Sequence[str], options: ApplyOptions, *, max_changes: int = 1_000_000,
           spill_bytes: int | None = None) -> list[BatchResult]:
    summary = RunSummary()
    sink = DeltaSink(BatchApplier(spark, options), summary)
    with ReplicationCore(sink, cut=BatchCut(max_changes), spill_bytes=spill_bytes) as core, \
            progress("replay", None, unit="changes") as advance:
        for changes in core.write_all(read_captures(paths), "the capture"):
            advance(changes)
    return summary.batches


def replay_changelog(spark: SparkSession, config: Config, options: ApplyOptions, *, table: str | None = None,
                     until_lsn: int | None = None, max_changes: int = 1_000_000) -> list[BatchResult]:
    """The change log's transactions (of one table, ``schema.table``; up to a commit LSN) applied to
    the targets of ``options.warehouse``, in windows of whole transactions of about ``max_changes``
    rows (a larger transaction is a window of its own). A target whose version is past what the log
    holds is refused: the log lacks changes it has; so is a table whose rows began with an initial
    copy that the log lacks (or that comes after ``until_lsn``), unless its target holds that copy."""
    changelog = ChangeLog(spark, config)
    held = changelog.version
    copies = changelog.copies()
    _refuse_targets_ahead(spark, options, changelog, held, copies)
    frame = changelog.read(table, until_lsn)
    if changelog.trimmed_through is not None:
        _refuse_tables_trimmed_past(spark, options, changelog, frame)
    _refuse_tables_without_their_copy(spark, options, changelog, table, until_lsn, copies)
    applier = ChangeLogApplier(changelog, BatchApplier(spark, options, _missing_value_if_reachable(config)),
                               max_changes=max_changes, spill_bytes=config.batching.spill_bytes)
    windows = applier.windows(frame)
    with progress("replay of the change log", sum(w.rows for w in windows), unit="changes") as advance:
        return applier.apply(frame, advance, windows=windows)


def _missing_value_if_reachable(config: Config) -> MissingValueLookup:
    """An ADD COLUMN ... DEFAULT since a table's copy: the rows the copy logged are older than the
    column, and PostgreSQL gives them the default. The value comes from the source's catalog, as in a
    live run. A rebuild may run when the source is gone: then a warning names the column, and those
    rows keep NULL."""
    def lookup(relation_oid: int, column: str) -> MissingValue:
        try:
            return SourceCatalog.of(config.source).missing_value(relation_oid, column)
        except CdcApplyError as exc:
            log.warning("%s; rows older than the column keep NULL in the rebuilt target", exc)
            return SourceMissingValue(False, None, False)
    return lookup


def _refuse_tables_trimmed_past(spark: SparkSession, options: ApplyOptions, changelog: ChangeLog,
                                frame: DataFrame) -> None:
    """Each table the replay would apply must hold the log up to where ``trim`` removed it."""
    registry = TargetRegistry(options.state)
    for row in frame.select("relation_oid", "schema", "table").distinct().collect():
        holds = _target_holds(spark, options, row["relation_oid"], registry.get(row["relation_oid"]))
        changelog.refuse_if_trimmed_past(f"{row['schema']}.{row['table']}", holds)


def _refuse_tables_without_their_copy(spark: SparkSession, options: ApplyOptions, changelog: ChangeLog,
                                      table: str | None, until_lsn: int | None, copies: dict[int, RecordedCopy]) -> None:
    """Each table the replay would apply whose rows began with an initial copy must have a target that
    holds the copy already, unless the log holds the copy's rows and the replay reaches it."""
    registry = TargetRegistry(options.state)
    for oid, copy in copies.items():
        if table is None or copy.table == table:
            changelog.refuse_if_copy_missing(oid, copy, _target_holds(spark, options, oid, registry.get(oid)),
                                             until_lsn)


def _target_holds(spark: SparkSession, options: ApplyOptions, oid: int, entry: dict[str, Any] | None) -> int | None:
    """The commit LSN the pipeline last applied to the relation's target in ``options.warehouse``
    (its registry ``entry``); None when it has none."""
    target = target_at(spark, options, entry["location"], entry["by_name"]) if entry else None
    return target.committed_version(f"{options.pipeline}/{oid}") if target is not None and target.exists() else None


def _refuse_targets_ahead(spark: SparkSession, options: ApplyOptions, changelog: ChangeLog, held: int | None,
                          copies: dict[int, RecordedCopy]) -> None:
    """A target past the log: unless its version is the copy the log recorded (a table copied after
    the log's last transaction), it holds changes the log lacks."""
    for oid, entry in TargetRegistry(options.state).entries().items():
        version = _target_holds(spark, options, oid, entry)
        if version is not None and (held is None or version > held) and \
                (oid not in copies or version != copies[oid].version):
            raise ChangeLogError(
                f"{entry['schema']}.{entry['table']}: its target holds changes up to LSN {format_lsn(version)}, "
                f"past the change log {changelog.target.location} (up to "
                f"{'nothing' if held is None else format_lsn(held)}): the log was enabled after them, so a replay "
                "would miss them; replay into another warehouse (--warehouse) after a resync, or start the log first")


def table_totals(results: Sequence[BatchResult]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Per table: I/U/D/T counts and keys merged over the batches; and batches skipped as already applied."""
    totals: dict[str, dict[str, int]] = {}
    skipped: dict[str, int] = {}
    for batch in results:
        for table in batch.tables:
            if table.skipped:
                skipped[table.table] = skipped.get(table.table, 0) + 1
                continue
            counts = totals.setdefault(table.table, {"I": 0, "U": 0, "D": 0, "T": 0, "keys": 0})
            for op, count in table.ops.items():
                counts[op] += count
            counts["keys"] += table.keys_written
    return totals, skipped


def print_summary(results: Sequence[BatchResult], out: TextIO) -> None:
    totals, skipped = table_totals(results)
    side_columns: dict[str, dict[str, str]] = {}
    text_columns: dict[str, list[str]] = {}
    for batch in results:
        for table in batch.tables:
            if table.side_columns:
                side_columns[table.table] = table.side_columns
            if table.text_columns:
                text_columns[table.table] = table.text_columns
    lsns = [b.first_lsn for b in results if b.first_lsn] + [b.last_lsn for b in results if b.last_lsn]
    seconds = sum(b.seconds for b in results)
    changes = sum(b.changes for b in results)
    span = f"{format_lsn(min(lsns))} .. {format_lsn(max(lsns))}" if lsns else "-"
    out.write(f"batches {len(results)}, transactions {sum(b.transactions for b in results)}, changes {changes}, "
              f"LSN {span}, {seconds:.1f} s ({changes / seconds if seconds else 0:,.1f} changes/s)\n")
    for table in sorted(set(totals) | set(skipped)):
        counts = totals.get(table, {"I": 0, "U": 0, "D": 0, "T": 0, "keys": 0})
        out.write(f"  {table:30s} I {counts['I']:>8} U {counts['U']:>8} D {counts['D']:>8} T {counts['T']:>3} "
                  f"keys merged {counts['keys']:>8}"
                  + (f"  (already applied in {skipped[table]} batch(es): skipped)" if table in skipped else "") + "\n")
        if table in side_columns:
            moved = ", ".join(f"{source} -> {column}" for source, column in sorted(side_columns[table].items()))
            out.write(f"    {'':30s}source columns written to other target columns: {moved} (docs/apply.md)\n")
        if table in text_columns:
            out.write(f"    {'':30s}columns kept as PostgreSQL's text, since a value did not fit their type: "
                      f"{', '.join(text_columns[table])} (docs/apply.md)\n")
