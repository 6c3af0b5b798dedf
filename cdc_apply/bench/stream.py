"""`cdc-apply bench stream`: the Structured Streaming apply against `run --follow`, one server, one run.

1. Steady load (``--rate`` transactions/s per session for ``--seconds``), first through
   `run --follow`, then through the streaming query (format("pgoutput") -> foreach_batch):
   changes/s applied and the lag from commit in PostgreSQL to visible in Delta (p50, p99).
2. Backlog: an unthrottled load with both stopped, each on its own slot. The walsender's own
   delivery rate of it (a third slot), then each pipeline's catch-up rate over the same WAL.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.bench import scratch_directory
from cdc_apply.bench.e2e import backlog, bench_config, catchup_between_deliveries, delivery_slots, steady_follow
from cdc_apply.bench.load import Load, create_schema
from cdc_apply.config import Config
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.slot import create_slot
from cdc_apply.spark.session import session_for
from cdc_apply.stream_job import start_stream

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_apply.sink import RunSummary


def steady_stream(server: PgServer, config: Config, spark: SparkSession, seconds: float, rate: float,
                  sessions: int, seed: int = 3) -> tuple[float, RunSummary]:
    """The streaming query under a steady load (its own seed: the rows differ from the follow phase's)."""
    query, apply = start_stream(config, spark, with_function=True)
    try:
        load = Load(server.dsn, sessions=sessions, rate_per_session=rate, big_every=0, seed=seed).start()
        started = time.perf_counter()
        time.sleep(seconds)
        load.finish()
        query.processAllAvailable()
        elapsed = time.perf_counter() - started
    finally:
        query.stop()
    summary = apply.summary
    return sum(b.changes for b in summary.batches) / elapsed, summary


def catchup_stream(config: Config, spark: SparkSession) -> tuple[int, float]:
    config = config.model_copy(update={"stream": config.stream.model_copy(update={"trigger": "available_now"})})
    started = time.perf_counter()
    query, apply = start_stream(config, spark, with_function=True)
    query.awaitTermination()
    seconds = time.perf_counter() - started
    return sum(b.changes for b in apply.summary.batches), seconds


def bench_stream(seconds: float = 20.0, rate: float = 40.0, sessions: int = 2,
                 spark: SparkSession | None = None) -> dict[str, float]:
    """``spark``: a session to run in (a test's), else a new one."""
    root = scratch_directory("cdc_apply_bench_stream_")
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            create_schema(conn, "bench")
        follow = bench_config(server, f"{root}/follow", "follow")
        stream = bench_config(server, f"{root}/stream", "stream")
        with session_for(spark, follow.spark) as spark:
            result: dict[str, float] = {}
            print(f"1/2 steady load: {sessions} sessions x {rate:g} tx/s for {seconds:g} s, "
                  "through run --follow, then through the streaming query ...", flush=True)
            for name, steady in (("follow", steady_follow), ("stream", steady_stream)):
                config = follow if name == "follow" else stream
                with psycopg.connect(server.dsn, autocommit=True) as conn:
                    create_slot(conn, name)  # now: a slot made earlier would hold the other phase's load too
                changes_per_s, summary = steady(server, config, spark, seconds, rate, sessions)
                result[f"{name}_steady_changes_per_s"] = changes_per_s
                result[f"{name}_lag_p50_s"] = summary.lag_percentile(0.5) or 0.0
                result[f"{name}_lag_p99_s"] = summary.lag_percentile(0.99) or 0.0

            print(f"2/2 backlog: unthrottled load for {seconds:g} s with both stopped ...", flush=True)
            slots = delivery_slots(server, "delivery")
            upto = backlog(server, seconds, sessions)
            _, rates, caught_up = catchup_between_deliveries(server, follow, spark, slots, upto)
            # the faster of the timings before and after run --follow's catch-up
            result["delivery_changes_per_s"] = max(rates)
            for name, (changes, took) in (("follow", (caught_up.changes, caught_up.seconds)),
                                          ("stream", catchup_stream(stream, spark))):
                result[f"{name}_catchup_changes_per_s"] = changes / took
                result[f"ratio_{name}_catchup_to_delivery"] = changes / took / result["delivery_changes_per_s"]
    print(f"bench stream ({sessions} sessions, {seconds:g} s per phase)")
    for name, label in (("follow", "run --follow"), ("stream", "streaming query")):
        print(f"  {label:<16} steady {result[f'{name}_steady_changes_per_s']:>8,.0f} changes/s, "
              f"lag p50 {result[f'{name}_lag_p50_s']:.2f} s, p99 {result[f'{name}_lag_p99_s']:.2f} s; "
              f"catch-up {result[f'{name}_catchup_changes_per_s']:>8,.0f} changes/s, "
              f"ratio to delivery {result[f'ratio_{name}_catchup_to_delivery']:.3f}x")
    print(f"  walsender delivery {result['delivery_changes_per_s']:>10,.0f} changes/s")
    print(f"  streaming query / run --follow: steady "
          f"{result['stream_steady_changes_per_s'] / result['follow_steady_changes_per_s']:.2f}x, catch-up "
          f"{result['stream_catchup_changes_per_s'] / result['follow_catchup_changes_per_s']:.2f}x")
    return result
