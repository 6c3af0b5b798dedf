"""`cdc-apply bench NAME`: benchmarks that report ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile

from cdc_apply.bench.store import object_store


def scratch_directory(prefix: str) -> str:
    """A new directory for one bench's warehouse and files, removed when the process ends (a bench
    run by the tests would otherwise leave one in /tmp each time)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def run_bench(name: str, args: argparse.Namespace) -> int:
    if name == "decode":
        from cdc_apply.bench.decode import bench_decode

        bench_decode(messages=args.messages, binary=args.binary, rounds=args.rounds, load=args.load)
        return 0
    if name == "apply":
        from cdc_apply.bench.apply import bench_apply

        bench_apply(rows=args.rows or 10_000_000, changes=args.changes, per_transaction_slice=args.per_transaction_slice,
                    connect=args.connect)
        return 0
    if name == "e2e":
        from cdc_apply.bench.e2e import bench_e2e

        with object_store(args.warehouse, args.config) as store:
            bench_e2e(seconds=args.seconds, rate=args.rate, sessions=args.sessions,
                      parallel_tables=args.parallel_tables, capacity_steps=args.capacity_steps,
                      changelog=args.changelog, store=store, connect=args.connect,
                      warm_ups=args.warm_ups)
        return 0
    if name == "memory":
        from cdc_apply.bench.memory import bench_memory

        bench_memory(megabytes=args.megabytes, updates=args.updates, changelog=args.changelog)
        return 0
    if name == "soak":
        from cdc_apply.bench.soak import bench_soak

        bench_soak(minutes=args.minutes, rate=args.rate, sessions=args.sessions, parallel_tables=args.parallel_tables)
        return 0
    if name == "stream":
        from cdc_apply.bench.stream import bench_stream

        bench_stream(seconds=args.seconds, rate=args.rate, sessions=args.sessions)
        return 0
    if name == "failover":
        from cdc_apply.bench.failover import bench_failover

        bench_failover(rounds=args.rounds, rate=args.rate)
        return 0
    if name == "snapshot":
        from cdc_apply.bench.snapshot import bench_snapshot

        with object_store(args.warehouse, args.config) as store:
            bench_snapshot(rows=args.rows or 2_000_000, changelog=args.changelog, store=store)
        return 0
    if name == "restart":
        from cdc_apply.bench.restart import bench_restart

        if args.mode not in ("follow", "stream"):
            print(f"bench restart: --mode is follow or stream, not {args.mode}", file=sys.stderr)
            return 2
        bench_restart(rounds=args.rounds, mode=args.mode, connect=args.connect)
        return 0
    if name == "crash":
        from cdc_apply.bench.crash import bench_crash

        with object_store(args.warehouse, args.config) as store:
            result = bench_crash(mode=args.mode, kills=args.kills, seed=args.seed, store=store)
        return 0 if result["lost"] == result["applied_twice"] == result["problems_after_kills"] \
            == result["tables_differing"] == 0 else 1
    raise ValueError(f"unknown benchmark {name}")
