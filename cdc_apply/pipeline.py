"""SQL-interface batch mode (`run --once`): peek -> decode -> assemble -> apply -> advance. The walsender
loop for `run --follow` is `cdc_apply.live`.

Each round peeks at most ``batching.max_changes`` messages from the slot (whole transactions, up to
the WAL position the run started at), applies the committed transactions, and only then advances
the slot. Invariants:
- The slot is never confirmed past a transaction that is not durable in every target: the
  advance comes after ``BatchApplier.apply`` returns, and never passes an open streamed or a
  prepared-but-undecided transaction (``Assembler.safe_confirm_lsn``).
- A crash between apply and advance re-reads the same transactions next time; the targets' Delta
  transaction versions make the second apply a no-op.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.apply.batch import BatchApplier, BatchResult
from cdc_apply.apply.options import apply_options
from cdc_apply.assemble import Assembler, Transaction
from cdc_apply.config import Config
from cdc_apply.lsn import format_lsn, parse_lsn, pg_us_to_unix_us
from cdc_apply.metrics import PipelineMetrics
from cdc_apply.sources.preflight import check_source, ensure_publication_and_slot, protocol_options
from cdc_apply.failpoints import failpoint
from cdc_apply.snapshot import Snapshotter, TableSnapshot
from cdc_apply.sources.catalog import SourceCatalog
from cdc_apply.sources.health import HealthMonitor
from cdc_apply.sources.slot import (
    PgOutputOptions, advance_slot, confirmed_flush, read_changes, server_version_num,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What a run did: batches applied, tables copied, lag, where the slot was confirmed to."""

    batches: list[BatchResult] = field(default_factory=list)
    confirmed_lsn: int | None = None
    rounds: int = 0
    snapshots: list[TableSnapshot] = field(default_factory=list)
    lag_seconds: list[float] = field(default_factory=list)  # commit in PostgreSQL -> visible in Delta
    reconnects: int = 0
    metrics: PipelineMetrics | None = None  # told every batch, when the run exports metrics

    def record(self, result: BatchResult, transactions: list[Transaction]) -> None:
        visible_at = time.time()
        self.batches.append(result)
        lags = [visible_at - pg_us_to_unix_us(t.commit_ts) / 1e6 for t in transactions]
        self.lag_seconds += lags
        if self.metrics is not None:
            self.metrics.batch_applied(result, transactions, lags)

    def lag_percentile(self, fraction: float) -> float | None:
        if not self.lag_seconds:
            return None
        ordered = sorted(self.lag_seconds)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop stops after the current batch."""

    def __init__(self) -> None:
        self.event = threading.Event()

    @contextmanager
    def on_signals(self) -> Iterator[StopFlag]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, lambda *_: self.event.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _has_configured_keys(config: Config) -> Callable[[str, str], bool]:
    options = apply_options(config)
    return lambda schema, table: bool(options.for_table(schema, table).keys)


def _prepare(conn: psycopg.Connection, config: Config) -> PgOutputOptions:
    """Check the source, create what the config asks for, and choose the protocol options."""
    check_source(conn, config.source, _has_configured_keys(config))
    ensure_publication_and_slot(conn, config.source)
    HealthMonitor(config.source).check(conn, starting=True)
    return protocol_options(config.source, server_version_num(conn))


def prepare_source(config: Config) -> PgOutputOptions:
    with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
        return _prepare(conn, config)


def drain(config: Config, spark: SparkSession, *, stop: StopFlag | None = None) -> RunSummary:
    """Apply everything the slot holds up to the current WAL position, then return."""
    summary = RunSummary()
    source = config.source
    with psycopg.connect(source.conninfo(), autocommit=True) as conn:
        options = _prepare(conn, config)
        upto = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
        applier = BatchApplier(spark, apply_options(config), missing_value=SourceCatalog(source.conninfo()).missing_value)
        snapshotter = Snapshotter(config, applier)
        summary.snapshots += snapshotter.sync()
        log.info("reading slot %s of %s up to %s", source.slot, source.describe(), format_lsn(upto))
        limit = config.batching.max_changes
        while stop is None or not stop.event.is_set():
            summary.rounds += 1
            assembler = Assembler(spill_bytes=config.batching.spill_bytes, skip_origins=source.skip_origins)
            try:
                raws = list(read_changes(conn, source.slot, options, upto_lsn=upto, upto_nchanges=limit))
                if not raws:
                    break
                failpoint("after_receive")
                transactions = list(assembler.transactions(raws))
                if transactions:
                    failpoint("after_decode")
                    summary.snapshots += snapshotter.sync_new(transactions)
                    summary.record(applier.apply(transactions), transactions)
                confirm = assembler.safe_confirm_lsn(transactions[-1].end_lsn) if transactions else 0
            finally:
                assembler.close()
            if confirm <= confirmed_flush(conn, source.slot):
                if len(raws) >= limit:
                    limit *= 2  # one transaction is larger than the window: widen it and read again
                    continue
                break  # only undecided (prepared or open streamed) transactions are left
            failpoint("before_confirm")
            advance_slot(conn, source.slot, confirm)
            summary.confirmed_lsn = confirm
            limit = config.batching.max_changes
            log.info("confirmed slot %s to %s", source.slot, format_lsn(confirm))
    return summary


def capture(config: Config, out: str, *, consume: bool = False) -> tuple[int, str]:
    """Write what the slot holds (up to the current WAL position) to a capture file, plus manifest.json.

    Returns (messages written, manifest path). The slot is advanced only with ``consume``.
    """
    import json
    from pathlib import Path

    from cdc_apply.sources.capture import PARQUET_SUFFIXES, write_jsonl, write_parquet

    source = config.source
    with psycopg.connect(source.conninfo(), autocommit=True) as conn:
        options = _prepare(conn, config)
        version = server_version_num(conn)
        upto = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
        raws = list(read_changes(conn, source.slot, options, upto_lsn=upto))
        path = Path(out)
        writer = write_parquet if path.suffix.lower() in PARQUET_SUFFIXES else write_jsonl
        count = writer(path, raws)
        manifest = path.with_name("manifest.json")
        manifest.write_text(json.dumps({
            "file": path.name, "messages": count, "server_version_num": version, "slot": source.slot,
            "options": dict(options.as_pairs()), "first_lsn": format_lsn(raws[0].lsn) if raws else None,
            "last_lsn": format_lsn(raws[-1].lsn) if raws else None}, indent=1))
        if consume and raws:
            assembler = Assembler(skip_origins=source.skip_origins)
            try:
                transactions = list(assembler.transactions(raws))
                if transactions:
                    advance_slot(conn, source.slot, assembler.safe_confirm_lsn(transactions[-1].end_lsn))
            finally:
                assembler.close()
    return count, str(manifest)
