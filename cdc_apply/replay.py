"""`cdc-apply replay`: capture files -> committed transactions -> batches -> Delta targets.

The replication core (``cdc_apply.replication``) over files, with nothing to confirm: decode,
assemble, cut batches at transaction boundaries, apply each batch. Replaying a capture twice changes nothing (exactly-once versions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from cdc_apply.apply.batch import BatchApplier, BatchResult
from cdc_apply.apply.options import ApplyOptions
from cdc_apply.lsn import format_lsn
from cdc_apply.progress import progress
from cdc_apply.replication import BatchCut, ReplicationCore
from cdc_apply.sink import DeltaSink, RunSummary
from cdc_apply.sources.capture import read_captures

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def replay(spark: SparkSession, paths: Sequence[str], options: ApplyOptions, *, max_changes: int = 1_000_000,
           spill_bytes: int | None = None) -> list[BatchResult]:
    summary = RunSummary()
    sink = DeltaSink(BatchApplier(spark, options), summary)
    with ReplicationCore(sink, cut=BatchCut(max_changes), spill_bytes=spill_bytes) as core, \
            progress("replay", None, unit="changes") as advance:
        for changes in core.write_all(read_captures(paths), "the capture"):
            advance(changes)
    return summary.batches


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
