"""`cdc-apply bench e2e`: PostgreSQL -> walsender -> decode -> MERGE into Delta, under load, in one run.

1. Steady load: ``--rate`` transactions/s per session for ``--seconds`` while `run --follow` streams;
   reports the achieved changes/s and the lag from commit in PostgreSQL to visible in Delta (p50, p99).
   It runs twice: a new JVM compiles Spark's and Delta's code during its first minute (each MERGE
   takes up to twice as long), so the first run warms it up and is reported apart (its p99).
2. Backlog: the same load, unthrottled, with the pipeline stopped. Then the walsender's own delivery
   rate of that backlog (a second slot, frames read and dropped) and the pipeline's catch-up rate
   over the same WAL; their ratio is the figure to compare. The delivery is timed twice, before
   and after the catch-up (a slot each), and the faster is the one compared: one timing swung
   from 81k to 187k changes/s between backlogs of one run (2026-11-28). With it, the driver's CPU
   per change over the catch-up (this Python process, user and system time, every thread; and of
   it the replication loop's thread).
"""

from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING, NamedTuple

import psycopg

from cdc_apply.bench import scratch_directory
from cdc_apply.bench.load import Load, create_schema
from cdc_apply.config import Config, parse_config
from cdc_apply.live import BackgroundReplicator
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgoutput.decoder import PgOutputDecoder
from cdc_apply.pgoutput.framing import XLogData
from cdc_apply.bench.store import ObjectStore
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.preflight import protocol_options
from cdc_apply.sources.slot import create_slot, server_version_num, wait_until_caught_up
from cdc_apply.sources.walsender import WalSenderStream
from cdc_apply.spark.session import session_for

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_apply.sink import RunSummary


class Delivery(NamedTuple):
    changes: int  # DML messages
    seconds: float
    last_end: int  # the end LSN of the last transaction


class CatchUp(NamedTuple):
    """``run --follow`` over a backlog (``catchup_follow``)."""

    changes: int
    confirmed_seconds: float  # until the slot is confirmed at the backlog's end
    seconds: float  # until the targets hold it (the same without ``confirm_after: changelog``)
    # CPU of this Python process until the slot is confirmed (every thread: receive, assembly, the
    # change rows, the change log's rows and files, py4j; the JVM is a process of its own) ...
    driver_cpu_seconds: float
    # ... of it, the replication loop's thread (receive, split, decode, assembly; under
    # ``confirm_after: changelog`` also the wait for the log's append)
    loop_cpu_seconds: float
    # ... of the process's CPU, the kernel's share, and the minor page faults behind most of it: each
    # first touch of memory the process had not used yet (or had given back) costs a fault
    driver_system_seconds: float
    minor_faults: int

    def us_per_change(self, cpu_seconds: float) -> float:
        return cpu_seconds / max(self.changes, 1) * 1e6

    def faults_per_change(self) -> float:
        return self.minor_faults / max(self.changes, 1)


def _delivery(server: PgServer, config: Config, slot: str, upto: int) -> Delivery:
    """DML messages the walsender sends for the slot up to ``upto``, the seconds it takes, and the
    end LSN of the last transaction among them: a pipeline has caught up with the backlog once its
    slot is confirmed there. (The WAL goes on past it with records no slot reader is sent; the slot
    moves over those only at the server's next keepalive, which is ``source.status_interval_seconds``
    away at most: waiting for that made one catch-up figure 10 s slower than the next.)"""
    with psycopg.connect(server.dsn) as conn:
        options = protocol_options(config.source, server_version_num(conn))
    stream = WalSenderStream(server.dsn, slot, options)
    changes = 0
    last_end = 0
    decoder = PgOutputDecoder()
    started = time.perf_counter()
    stream.start()
    while stream.received_lsn < upto:
        reply = False
        for frame in stream.read(timeout=2.0):
            if isinstance(frame, XLogData):
                tag = frame.payload[:1]
                if tag in (b"I", b"U", b"D", b"T"):
                    changes += 1
                elif tag in (b"C", b"c"):  # Commit, Stream Commit
                    last_end = decoder.decode(frame.payload).end_lsn  # type: ignore[attr-defined]
            else:
                reply = reply or frame.reply_requested
        # As often as the pipeline reports: a status update after every read (a few frames each, when
        # the reader keeps up) made this delivery 4-6% slower than the pipeline's own reads (2026-11-28).
        if reply or stream.status_due(config.source.status_interval_seconds):
            stream.send_status(0)
    seconds = time.perf_counter() - started
    stream.close()
    return Delivery(changes, seconds, last_end)


def delivery_slots(server: PgServer, name: str) -> tuple[str, str]:
    """Two slots at the WAL position now, for timing a backlog's delivery before and after a catch-up."""
    slots = (f"{name}_before", f"{name}_after")
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        for slot in slots:
            create_slot(conn, slot)
    return slots


def catchup_between_deliveries(server: PgServer, config: Config, spark: SparkSession, slots: tuple[str, str],
                               upto: int) -> tuple[Delivery, list[float], CatchUp]:
    """The backlog up to ``upto`` delivered on ``slots[0]``, the pipeline's catch-up over it
    (``catchup_follow``), then delivered again on ``slots[1]``: (the first delivery, both delivery
    rates in changes/s, the catch-up)."""
    before = _delivery(server, config, slots[0], upto)
    caught_up = catchup_follow(server, config, spark, before.last_end)
    after = _delivery(server, config, slots[1], upto)
    return before, [d.changes / d.seconds for d in (before, after)], caught_up


def steady_follow(server: PgServer, config: Config, spark: SparkSession, seconds: float, rate: float,
                  sessions: int, seed: int = 1, first: bool = True) -> tuple[float, RunSummary]:
    """``run --follow`` under a steady load: (changes/s applied, its run summary with the lag).
    ``first``: the pipeline's first run, which creates the slot and copies the (empty) tables."""
    pipeline = BackgroundReplicator(config, spark).start()
    if first:
        pipeline.wait_for_snapshots()  # the slot and the (empty) targets exist
    load = Load(server.dsn, sessions=sessions, rate_per_session=rate, big_every=0, seed=seed).start()
    started = time.perf_counter()
    time.sleep(seconds)
    load.finish()
    pipeline.wait_caught_up(timeout=600)
    elapsed = time.perf_counter() - started
    pipeline.finish()
    summary = pipeline.replicator.summary
    return sum(b.changes for b in summary.batches) / elapsed, summary


def backlog(server: PgServer, seconds: float, sessions: int, seed: int = 2) -> int:
    """An unthrottled load for ``seconds`` with every pipeline stopped; the WAL position it ends at.
    Each load of one run needs its own ``seed``: the seed picks its keys."""
    load = Load(server.dsn, sessions=sessions, rate_per_session=None, big_every=0, seed=seed).start()
    time.sleep(seconds)
    load.finish()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        return parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]


def catchup_follow(server: PgServer, config: Config, spark: SparkSession, last_end: int) -> CatchUp:
    """``run --follow`` over the slot's backlog up to ``last_end``, the end of its last transaction."""
    cpu_started, usage_started = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    pipeline = BackgroundReplicator(config, spark).start()
    assert pipeline.thread.ident is not None
    loop_clock = time.pthread_getcpuclockid(pipeline.thread.ident)
    wait_until_caught_up(server.dsn, config.source.slot, 1800, running=pipeline.thread.is_alive, lsn=last_end)
    confirmed = time.perf_counter() - started
    driver_cpu, loop_cpu = time.process_time() - cpu_started, time.clock_gettime(loop_clock)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    pipeline.wait_caught_up(timeout=1800, lsn=last_end)
    seconds = time.perf_counter() - started
    pipeline.finish()
    return CatchUp(sum(b.changes for b in pipeline.replicator.summary.batches), confirmed, seconds, driver_cpu,
                   loop_cpu, usage.ru_stime - usage_started.ru_stime, usage.ru_minflt - usage_started.ru_minflt)


def _new_targets(config: Config, warehouse: str | None = None, spark: dict[str, str] | None = None,
                 **target: object) -> Config:
    """``config`` with new targets in ``warehouse`` (else a new local one) that take the changes from
    now on (no copy), the same slot; ``target``: other target keys, ``spark``: the ``spark`` section."""
    warehouse = warehouse or scratch_directory("cdc_apply_bench_again_")
    return config.model_copy(update={
        "target": config.target.model_copy(update={"warehouse": warehouse, **target}),
        "snapshot": config.snapshot.model_copy(update={"enabled": False}),
        **({"spark": spark} if spark is not None else {})})


def _again(server: PgServer, config: Config, spark: SparkSession, seconds: float, rate: float, sessions: int,
           seed: int, warm_ups: int, delivery_slot: str) -> dict[str, float]:
    """The steady load (after ``warm_ups`` runs of it that warm a new JVM up) and a backlog's catch-up
    again on ``config``'s targets (``_new_targets``), the backlog's delivery timed on ``delivery_slot``."""
    for run in range(warm_ups):
        steady_follow(server, config, spark, seconds, rate, sessions, seed=seed * 10 + run, first=False)
    _, steady = steady_follow(server, config, spark, seconds, rate, sessions, seed=seed + 1, first=False)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        create_slot(conn, delivery_slot)
    upto = backlog(server, seconds, sessions, seed=seed + 2)
    delivered = _delivery(server, config, delivery_slot, upto)
    caught_up = catchup_follow(server, config, spark, delivered.last_end)
    delivery = delivered.changes / delivered.seconds
    catchup = caught_up.changes / caught_up.seconds
    return {"lag_p50_s": steady.lag_percentile(0.5) or 0.0, "lag_p99_s": steady.lag_percentile(0.99) or 0.0,
            "catchup_changes": caught_up.changes, "catchup_changes_per_s": catchup,
            "delivery_changes_per_s": delivery, "ratio_catchup_to_delivery": catchup / delivery}


def _public_only(server: PgServer, config: Config, spark: SparkSession, seconds: float, rate: float,
                 sessions: int) -> dict[str, float]:
    """The steady load and a backlog's catch-up again on the classic session with Delta's public APIs
    only (``target.delta_internals: false``): every commit then carries its ``txnAppId`` check, as
    on Connect, so Connect ÷ this is what Connect itself costs, and this ÷ classic what the
    internal path buys (docs/spark.md, "What the internal path buys")."""
    figures = _again(server, _new_targets(config, delta_internals=False), spark, seconds, rate, sessions,
                     seed=30, warm_ups=0, delivery_slot="public_delivery")
    return {f"public_{key}": value for key, value in figures.items()}


def _on_connect(server: PgServer, config: Config, seconds: float, rate: float, sessions: int,
                warm_ups: int) -> dict[str, float]:
    """The steady load (``warm_ups`` runs, then the measured one) and a backlog's catch-up, as on the
    classic session, with ``run --follow`` a Connect client: new targets, the same slot."""
    from cdc_apply.spark.connect_server import ConnectServer
    from cdc_apply.spark.session import build_spark_session

    with ConnectServer({"spark.master": "local[2]"}) as connect_server:
        remote = {"spark.remote": connect_server.url}
        client = build_spark_session(remote)
        try:
            figures = _again(server, _new_targets(config, spark=remote), client, seconds, rate, sessions,
                             seed=20, warm_ups=warm_ups, delivery_slot="connect_delivery")
        finally:
            client.stop()
    return {f"connect_{key}": value for key, value in figures.items()}


def with_changelog(config: Config) -> Config:
    """``config`` with the change log on, and the slot confirmed at it."""
    return config.model_copy(update={"changelog": config.changelog.model_copy(
        update={"enabled": True, "confirm_after": "changelog"})})


def capacity(server: PgServer, config: Config, spark: SparkSession, seconds: float, rate: float,
             sessions: int, steps: int) -> tuple[float, list[tuple[float, float, float]]]:
    """Double the steady rate from ``rate`` until the lag p99 passes ``CAPACITY_LAG_S`` (or ``steps``
    rates were tried): the highest changes/s held, and (tx/s per session, changes/s, p99) per step."""
    held = 0.0
    tried = []
    for step in range(steps):
        step_rate = rate * 2 ** step
        applied, summary = steady_follow(server, config, spark, seconds, step_rate, sessions, seed=10 + step,
                                         first=False)
        p99 = summary.lag_percentile(0.99) or 0.0
        tried.append((step_rate, applied, p99))
        print(f"  capacity step {step + 1}: {sessions} x {step_rate:g} tx/s -> {applied:,.0f} changes/s, "
              f"lag p99 {p99:.2f} s", flush=True)
        if p99 > CAPACITY_LAG_S:
            break
        held = applied
    return held, tried


CAPACITY_LAG_S = 10.0


def bench_config(server: PgServer, warehouse: str, slot: str, parallel_tables: int = 4) -> Config:
    return parse_config({"pipeline": slot, "source": {"dsn": server.dsn, "slot": slot, "publication": "bench"},
                         "target": {"warehouse": warehouse},
                         "batching": {"max_seconds": 1.0, "max_changes": 200_000, "parallel_tables": parallel_tables},
                         "stream": {"interval_seconds": 1.0}})


def prepared(server: PgServer, slot: str, parallel_tables: int) -> Config:
    """The load's tables on ``server``, and a pipeline config for them on ``slot`` with a fresh warehouse."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        create_schema(conn, "bench")
    return bench_config(server, scratch_directory(f"cdc_apply_bench_{slot}_"), slot, parallel_tables)


def bench_e2e(seconds: float = 30.0, rate: float = 50.0, sessions: int = 2, parallel_tables: int = 4,
              capacity_steps: int = 4, changelog: bool = False, spark: SparkSession | None = None,
              store: ObjectStore | None = None, connect: bool = False, warm_ups: int = 1) -> dict[str, float]:
    """``changelog``: the steady load and the backlog are run again with ``changelog.confirm_after:
    changelog`` (same server, slot and targets), and both are reported side by side. ``spark``: a
    session to run in (a test's), else a new one. ``store``: the steady load again with the warehouse
    on that object store (same server and slot, new targets). ``connect``: the steady load and a
    backlog again on a Spark Connect client of a local Connect server started for it (same server
    and slot, new targets), beside the classic session's figures; before it, on the classic session,
    the same once more with Delta's public APIs only (``_public_only``). ``warm_ups``: the steady load's
    runs before the measured one in each new JVM, the classic session's and the Connect server's
    (the first run's p99 is reported apart)."""
    phases = 2 + changelog + (store is not None) + (capacity_steps > 0) + 2 * connect
    with PgServer() as server:
        config = prepared(server, "bench", parallel_tables)
        if store is not None:
            config = config.model_copy(update={"spark": {**config.spark, **store.spark_conf}})
        with session_for(spark, config.spark) as spark:

            print(f"1/{phases} steady load: {sessions} sessions x {rate:g} tx/s for {seconds:g} s while streaming, "
                  f"{warm_ups} time(s) to warm a new JVM up, then measured ...", flush=True)
            _, cold = steady_follow(server, config, spark, seconds, rate, sessions)
            for run in range(1, warm_ups):
                steady_follow(server, config, spark, seconds, rate, sessions, seed=40 + run, first=False)
            steady_rate, steady = steady_follow(server, config, spark, seconds, rate, sessions, seed=3, first=False)

            print(f"2/{phases} backlog: unthrottled load for {seconds:g} s with the pipeline stopped ...", flush=True)
            slots = delivery_slots(server, "delivery")
            upto = backlog(server, seconds, sessions)
            delivered, rates, caught_up = catchup_between_deliveries(server, config, spark, slots, upto)
            result = {
                "steady_changes_per_s": steady_rate,
                "lag_p50_s": steady.lag_percentile(0.5) or 0.0,
                "lag_p99_s": steady.lag_percentile(0.99) or 0.0,
                "cold_lag_p99_s": cold.lag_percentile(0.99) or 0.0,
                "delivery_changes_per_s": max(rates),
                "delivery_before_changes_per_s": rates[0],
                "delivery_after_changes_per_s": rates[1],
                "catchup_changes_per_s": caught_up.changes / caught_up.seconds,
                "catchup_driver_us_per_change": caught_up.us_per_change(caught_up.driver_cpu_seconds),
                "catchup_loop_us_per_change": caught_up.us_per_change(caught_up.loop_cpu_seconds),
                "catchup_system_us_per_change": caught_up.us_per_change(caught_up.driver_system_seconds),
                "catchup_minor_faults_per_change": caught_up.faults_per_change(),
            }
            if changelog:
                result.update(_changelog_phases(server, with_changelog(config), spark, seconds, rate, sessions, phases))
            if store is not None:
                print(f"{3 + changelog}/{phases} the steady load again, the warehouse on {store.warehouse} ...", flush=True)
                on_store = _new_targets(config, store.under("e2e"))
                _, stored = steady_follow(server, on_store, spark, seconds, rate, sessions, seed=7, first=False)
                result["store_lag_p50_s"] = stored.lag_percentile(0.5) or 0.0
                result["store_lag_p99_s"] = stored.lag_percentile(0.99) or 0.0
            held = 0.0
            if capacity_steps:
                print(f"{3 + changelog + (store is not None)}/{phases} capacity: the steady rate doubled from "
                      f"{rate:g} tx/s per session until the lag p99 passes {CAPACITY_LAG_S:g} s (at most {capacity_steps} rates) ...", flush=True)
                held, _ = capacity(server, config, spark, seconds, rate, sessions, capacity_steps)
            if connect:
                print(f"{phases - 1}/{phases} the steady load and a backlog again with Delta's public APIs only "
                      "(target.delta_internals: false) ...", flush=True)
                result.update(_public_only(server, config, spark, seconds, rate, sessions))
        if connect:  # after the classic session stopped: a process holds one kind of session at a time
            print(f"{phases}/{phases} the steady load and a backlog again on a Spark Connect session ...", flush=True)
            result.update(_on_connect(server, config, seconds, rate, sessions, warm_ups))
    result["ratio_catchup_to_delivery"] = result["catchup_changes_per_s"] / result["delivery_changes_per_s"]
    if connect:
        result["connect_catchup_slowdown"] = result["catchup_changes_per_s"] / result["connect_catchup_changes_per_s"]
        result["public_catchup_slowdown"] = result["catchup_changes_per_s"] / result["public_catchup_changes_per_s"]
        result["connect_catchup_slowdown_to_public"] = (result["public_catchup_changes_per_s"]
                                                        / result["connect_catchup_changes_per_s"])
    result["capacity_changes_per_s"] = held
    result["ratio_capacity_to_delivery"] = held / result["delivery_changes_per_s"]
    print(f"bench e2e ({sessions} sessions, {seconds:g} s per phase, {parallel_tables} table(s) at once)")
    print(f"  steady load            {result['steady_changes_per_s']:>10,.0f} changes/s applied, "
          f"lag p50 {result['lag_p50_s']:.2f} s, p99 {result['lag_p99_s']:.2f} s "
          f"(the first run, in a new JVM: p99 {result['cold_lag_p99_s']:.2f} s)")
    print(f"  walsender delivery     {result['delivery_changes_per_s']:>10,.0f} changes/s "
          f"({delivered.changes:,} changes; the faster of two timings, {rates[0]:,.0f} before the catch-up and "
          f"{rates[1]:,.0f} after it)")
    print(f"  pipeline catch-up      {result['catchup_changes_per_s']:>10,.0f} changes/s "
          f"({caught_up.changes:,} changes in {caught_up.seconds:.2f} s)  "
          f"ratio {result['ratio_catchup_to_delivery']:.3f}x (goal >= 0.4x)")
    print(f"  driver CPU per change  {result['catchup_driver_us_per_change']:.1f} us over the catch-up (this "
          f"process, every thread), of it the replication loop's thread {result['catchup_loop_us_per_change']:.1f} us; "
          f"system time {result['catchup_system_us_per_change']:.1f} us, "
          f"{result['catchup_minor_faults_per_change']:.2f} minor page faults per change")
    if changelog:
        _print_changelog(result)
    if connect:
        print(f"  on Spark Connect       steady lag p50 {result['connect_lag_p50_s']:.2f} s, "
              f"p99 {result['connect_lag_p99_s']:.2f} s (classic {result['lag_p99_s']:.2f} s: "
              f"{result['connect_lag_p99_s'] / max(result['lag_p99_s'], 1e-9):.2f}x); catch-up "
              f"{result['connect_catchup_changes_per_s']:,.0f} changes/s ({result['connect_catchup_changes']:,.0f} "
              f"changes), ratio to its delivery {result['connect_ratio_catchup_to_delivery']:.3f}x; Connect ÷ classic "
              f"catch-up {result['connect_catchup_slowdown']:.2f}x slower (goal <= 1.3x)")
        print(f"  public Delta APIs only steady lag p50 {result['public_lag_p50_s']:.2f} s, p99 "
              f"{result['public_lag_p99_s']:.2f} s ({result['public_lag_p99_s'] / max(result['lag_p99_s'], 1e-9):.2f}x "
              f"classic's with its internal append); catch-up {result['public_catchup_changes_per_s']:,.0f} changes/s, "
              f"{result['public_catchup_slowdown']:.2f}x slower; Connect ÷ this: p99 "
              f"{result['connect_lag_p99_s'] / max(result['public_lag_p99_s'], 1e-9):.2f}x, catch-up "
              f"{result['connect_catchup_slowdown_to_public']:.2f}x slower")
    if store is not None:
        print(f"  on the object store    lag p50 {result['store_lag_p50_s']:.2f} s, p99 {result['store_lag_p99_s']:.2f} s; "
              f"p99 on the store ÷ on the local disk {result['store_lag_p99_s'] / max(result['lag_p99_s'], 1e-9):.2f}x "
              "(goal <= 1.5x)")
    if capacity_steps:
        print(f"  capacity (p99 <= {CAPACITY_LAG_S:g} s) {held:>10,.0f} changes/s  "
              f"ratio {result['ratio_capacity_to_delivery']:.3f}x (goal >= 0.25x)")
    else:
        print("  capacity               not searched (--capacity-steps 0)")
    return result


def _changelog_phases(server: PgServer, config: Config, spark: SparkSession, seconds: float, rate: float,
                      sessions: int, phases: int) -> dict[str, float]:
    """The steady load and a backlog again, with ``confirm_after: changelog``: the lags to the log and
    to the targets, and the catch-up of the slot's confirmed position and of the targets, each
    against the walsender's delivery of the same backlog."""
    print(f"3/{phases} with the change log (confirm_after: changelog): the steady load, then a backlog ...",
          flush=True)
    _, steady = steady_follow(server, config, spark, seconds, rate, sessions, seed=5, first=False)
    slots = delivery_slots(server, "delivery_changelog")
    upto = backlog(server, seconds, sessions, seed=6)
    _, rates, caught_up = catchup_between_deliveries(server, config, spark, slots, upto)
    delivery = max(rates)
    return {
        "changelog_lag_p50_s": steady.lag_percentile(0.5, steady.changelog_lag_seconds) or 0.0,
        "changelog_lag_p99_s": steady.lag_percentile(0.99, steady.changelog_lag_seconds) or 0.0,
        "changelog_target_lag_p50_s": steady.lag_percentile(0.5) or 0.0,
        "changelog_target_lag_p99_s": steady.lag_percentile(0.99) or 0.0,
        "changelog_delivery_changes_per_s": delivery,
        "changelog_delivery_before_changes_per_s": rates[0],
        "changelog_delivery_after_changes_per_s": rates[1],
        "ratio_confirmed_catchup_to_delivery": caught_up.changes / caught_up.confirmed_seconds / delivery,
        "ratio_changelog_targets_catchup_to_delivery": caught_up.changes / caught_up.seconds / delivery,
        "confirmed_driver_us_per_change": caught_up.us_per_change(caught_up.driver_cpu_seconds),
        "confirmed_loop_us_per_change": caught_up.us_per_change(caught_up.loop_cpu_seconds),
        "confirmed_system_us_per_change": caught_up.us_per_change(caught_up.driver_system_seconds),
        "confirmed_minor_faults_per_change": caught_up.faults_per_change(),
    }


def _print_changelog(result: dict[str, float]) -> None:
    print(f"  with the change log    commit -> change log lag p50 {result['changelog_lag_p50_s']:.2f} s, "
          f"p99 {result['changelog_lag_p99_s']:.2f} s (goal p99 <= 2 s); commit -> target lag p50 "
          f"{result['changelog_target_lag_p50_s']:.2f} s, p99 {result['changelog_target_lag_p99_s']:.2f} s "
          f"(without: p50 {result['lag_p50_s']:.2f} s, p99 {result['lag_p99_s']:.2f} s)")
    print(f"  confirmed catch-up     ratio {result['ratio_confirmed_catchup_to_delivery']:.3f}x of the walsender's "
          f"delivery ({result['changelog_delivery_changes_per_s']:,.0f} changes/s, the faster of "
          f"{result['changelog_delivery_before_changes_per_s']:,.0f} before and "
          f"{result['changelog_delivery_after_changes_per_s']:,.0f} after; goal >= 0.6x); the targets "
          f"{result['ratio_changelog_targets_catchup_to_delivery']:.3f}x (without the log: "
          f"{result['ratio_catchup_to_delivery']:.3f}x)")
    print(f"  driver CPU per change  {result['confirmed_driver_us_per_change']:.1f} us until confirmed (this process, "
          f"every thread; goal <= 6 us), of it the replication loop's thread "
          f"{result['confirmed_loop_us_per_change']:.1f} us; system time {result['confirmed_system_us_per_change']:.1f} us, "
          f"{result['confirmed_minor_faults_per_change']:.2f} minor page faults per change")
