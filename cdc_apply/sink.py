"""The Delta sink of the replication core, and what a run did.

``DeltaSink.write_batch`` keeps the core's contract (``cdc_apply.replication.Sink``): it returns
only when every target's Delta commit of the batch is durable, and a batch written again is
skipped by the targets' exactly-once versions (docs/architecture.md, invariant 6). Before the
batch, a table the pipeline has not copied yet (added to the publication later) gets its
initial snapshot, and with ``changelog.enabled`` the batch's change rows are appended to the change
log (``changelog/log.py``), exactly once, before any target commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cdc_apply.apply.batch import BatchApplier, BatchResult
from cdc_apply.transactions import Transaction
from cdc_apply.changerows.columns import ParsedRows
from cdc_apply.lsn import pg_us_to_unix_us
from cdc_apply.metrics import PipelineMetrics


@dataclass
class TableSnapshot:
    """One table's initial copy, as a run reports it."""

    table: str
    rows: int
    consistent_lsn: int
    seconds: float
    method: str = "key order"  # "ranges": Spark's tasks copied it; "key order": the driver did


# The sink's two ports: what it asks of the copy and of the change log, which sit above it and hand
# themselves in (docs/architecture.md, "Import rules").
class NewTableCopier(Protocol):
    """Copies the tables a batch touches that have no target yet (``snapshot.Snapshotter``)."""

    def sync_new(self, transactions: list[Transaction]) -> list[TableSnapshot]: ...


class ChangeLogAppender(Protocol):
    """The change log that batches go to before any target (``changelog.ChangeLog``)."""

    pieces_written: int  # pieces of spilled transactions in the last append

    def append(self, transactions: list[Transaction]) -> int: ...


@dataclass
class RunSummary:
    """What a run did: batches applied, tables copied, lag, where the slot was confirmed to."""

    batches: list[BatchResult] = field(default_factory=list)
    confirmed_lsn: int | None = None
    rounds: int = 0
    snapshots: list[TableSnapshot] = field(default_factory=list)
    lag_seconds: list[float] = field(default_factory=list)  # commit in PostgreSQL -> visible in Delta
    visible_at: list[float] = field(default_factory=list)  # when each batch became visible (Unix time)
    lag_timeline: list[tuple[float, float]] = field(default_factory=list)  # (visible at, lag) per transaction
    reconnects: int = 0
    changelog_rows: int = 0  # change rows appended to the change log
    changelog_pieces: int = 0  # pieces of spilled transactions written to it
    changelog_lag_seconds: list[float] = field(default_factory=list)  # commit in PostgreSQL -> in the change log
    metrics: PipelineMetrics | None = None  # told every batch, when the run exports metrics

    def record(self, result: BatchResult, transactions: list[Transaction]) -> None:
        visible_at = time.time()
        self.batches.append(result)
        self.visible_at.append(visible_at)
        lags = [visible_at - pg_us_to_unix_us(t.commit_ts) / 1e6 for t in transactions]
        self.lag_seconds += lags
        self.lag_timeline += [(visible_at, lag) for lag in lags]
        if self.metrics is not None:
            self.metrics.batch_applied(result, transactions, lags)

    def logged(self, transactions: list[Transaction]) -> None:
        """The transactions' change log commit is durable."""
        now = time.time()
        lags = [now - pg_us_to_unix_us(t.commit_ts) / 1e6 for t in transactions]
        self.changelog_lag_seconds += lags
        if self.metrics is not None and transactions:
            self.metrics.changelog_appended(transactions[-1].commit_lsn, lags)

    def lag_percentile(self, fraction: float, lags: list[float] | None = None) -> float | None:
        """Of the commit -> target lags, or of ``lags``."""
        lags = self.lag_seconds if lags is None else lags
        if not lags:
            return None
        ordered = sorted(lags)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class DeltaSink:
    def __init__(self, applier: BatchApplier, summary: RunSummary, snapshotter: NewTableCopier | None = None,
                 changelog: ChangeLogAppender | None = None,
                 targets_from_changelog: Callable[[list[Transaction]], None] | None = None) -> None:
        """``snapshotter=None``: no source to copy from (replay). ``changelog``: the change log the
        batches go to first (``changelog.enabled``). ``targets_from_changelog``: under
        ``confirm_after: changelog``, told the batch instead of applying it once the log holds it
        (the targets follow from the log: ``changelog/follower.TargetFollower``)."""
        self.applier = applier
        self.summary = summary
        self.snapshotter = snapshotter
        self.changelog = changelog
        self.targets_from_changelog = targets_from_changelog

    def write_batch(self, batch: list[Transaction], *, stream_batch: tuple[str, int] | None = None,
                    parsed: ParsedRows | None = None) -> BatchResult | None:
        """``stream_batch`` and ``parsed``: a Structured Streaming micro-batch's identity and its rows as
        the data source parsed them (``BatchApplier.apply``). Returns what the targets applied; None
        when the targets follow from the change log instead."""
        if self.snapshotter is not None:
            self.summary.snapshots += self.snapshotter.sync_new(batch)
        if self.changelog is not None:
            self.summary.changelog_rows += self.changelog.append(batch)
            self.summary.changelog_pieces += self.changelog.pieces_written
            self.summary.logged(batch)
        if self.targets_from_changelog is not None:
            self.targets_from_changelog(batch)
            return None
        result = self.applier.apply(batch, stream_batch=stream_batch, parsed=parsed)
        self.summary.record(result, batch)
        return result
