"""`cdc-apply bench soak`: a steady load for ``--minutes`` while `run --follow` streams; does applying
slow down as the targets grow and collect commits?

Reports, from one run: each table's median batch time in the first and in the last minute and their
ratio (goal: at most 1.5x), the lag p50/p99 in the first and the last minute, the files and log
version of each target at the end, and how long reading each whole table then takes (Spark, and
delta-rs where it can read the table).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from cdc_apply.bench.e2e import prepared
from cdc_apply.bench.load import TABLES, Load
from cdc_apply.live import BackgroundReplicator
from cdc_apply.pgserver import PgServer
from cdc_apply.spark.session import session_for

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _minute_medians(samples: list[tuple[float, float]], started: float, minutes: float) -> tuple[float, float]:
    """Median of the values in the first and in the last minute of (time, value) samples."""
    first = [v for at, v in samples if at - started <= 60]
    last = [v for at, v in samples if at - started >= minutes * 60 - 60]
    return (statistics.median(first) if first else float("nan"), statistics.median(last) if last else float("nan"))


def bench_soak(minutes: float = 30.0, rate: float = 20.0, sessions: int = 2,
               parallel_tables: int = 4, spark: SparkSession | None = None) -> dict[str, float]:
    """``spark``: a session to run in (a test's), else a new one."""
    with PgServer() as server:
        config = prepared(server, "soak", parallel_tables)
        with session_for(spark, config.spark) as spark:
            warehouse = config.target.warehouse
            pipeline = BackgroundReplicator(config, spark).start()
            pipeline.wait_for_snapshots()
            print(f"soak: {sessions} sessions x {rate:g} tx/s for {minutes:g} min while streaming ...", flush=True)
            load = Load(server.dsn, sessions=sessions, rate_per_session=rate, big_every=0, seed=3).start()
            started = time.time()
            time.sleep(minutes * 60)
            load.finish()
            pipeline.wait_caught_up(timeout=900)
            summary = pipeline.finish()

            per_table: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for batch, visible_at in zip(summary.batches, summary.visible_at):
                for table in batch.tables:
                    if not table.skipped:
                        per_table[table.table].append((visible_at, table.seconds))
            result: dict[str, float] = {}
            print(f"bench soak ({minutes:g} min, {sessions} sessions x {rate:g} tx/s, {len(summary.batches)} batches)")
            first_lag, last_lag = _minute_medians(summary.lag_timeline, started, minutes)
            print(f"  lag median: first minute {first_lag:.2f} s, last minute {last_lag:.2f} s")
            worst = 0.0
            for name in sorted(per_table):
                first, last = _minute_medians(per_table[name], started, minutes)
                ratio = last / first if first else float("nan")
                worst = max(worst, ratio)
                result[f"{name}_batch_ratio"] = ratio
                print(f"  {name:18s} batch apply median: first minute {first:.2f} s, last minute {last:.2f} s, "
                      f"ratio {ratio:.2f}x (goal <= 1.5x)")
            result["worst_batch_ratio"] = worst
            for name in TABLES:
                path = f"{warehouse}/{name.replace('.', '/')}"
                detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
                history = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").first()
                read_started = time.perf_counter()
                rows = spark.read.format("delta").load(path).count()
                spark_read = time.perf_counter() - read_started
                print(f"  {name:18s} {rows:>9,} rows in {detail['numFiles']:>5} files, "
                      f"log version {history['version']}, "
                      f"whole-table read {spark_read:.2f} s (Spark){_delta_rs_read(path)}")
    return result


def _delta_rs_read(path: str) -> str:
    """How long delta-rs takes to read the whole table (it refuses some table features, docs/apply.md)."""
    try:
        import pyarrow as pa
        from deltalake import DeltaTable
    except ImportError:
        return ""
    started = time.perf_counter()
    try:
        rows = pa.RecordBatchReader.from_stream(DeltaTable(path).scan()).read_all().num_rows
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"; delta-rs: {str(exc).splitlines()[0][:80]}"
    return f", {time.perf_counter() - started:.2f} s (delta-rs, {rows:,} rows)"
