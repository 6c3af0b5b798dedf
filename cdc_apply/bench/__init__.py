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


# The arguments each bench takes (what its report records).
ARGUMENTS: dict[str, tuple[str, ...]] = {
    "decode": ("messages", "binary", "rounds", "load"),
    "apply": ("rows", "changes", "per_transaction_slice", "connect"),
    "e2e": ("seconds", "rate", "sessions", "parallel_tables", "capacity_steps", "changelog", "connect", "warm_ups",
            "warehouse"),
    "memory": ("megabytes", "updates", "changelog"),
    "soak": ("minutes", "rate", "sessions", "parallel_tables"),
    "stream": ("seconds", "rate", "sessions"),
    "failover": ("rounds", "rate"),
    "snapshot": ("rows", "changelog", "warehouse"),
    "restart": ("rounds", "mode", "connect"),
    "crash": ("mode", "kills", "seed", "warehouse"),
}


def run_bench(name: str, args: argparse.Namespace) -> int:
    """Runs the bench; with ``args.report``, writes its figures as a JSON report there
    (``bench/report.py``)."""
    code, figures = _run(name, args)
    if getattr(args, "report", None) and figures is not None:
        from cdc_apply.bench.report import write_report

        write_report(args.report, name, {key: getattr(args, key) for key in ARGUMENTS[name]}, figures)
        print(f"report: {args.report}")
    return code


def _run(name: str, args: argparse.Namespace) -> tuple[int, object]:
    """The bench's exit code and the figures it returned."""
    if name == "decode":
        from cdc_apply.bench.decode import bench_decode

        return 0, bench_decode(messages=args.messages, binary=args.binary, rounds=args.rounds, load=args.load)
    if name == "apply":
        from cdc_apply.bench.apply import bench_apply

        return 0, bench_apply(rows=args.rows or 10_000_000, changes=args.changes,
                              per_transaction_slice=args.per_transaction_slice, connect=args.connect)
    if name == "e2e":
        from cdc_apply.bench.e2e import bench_e2e

        with object_store(args.warehouse, args.config) as store:
            return 0, bench_e2e(seconds=args.seconds, rate=args.rate, sessions=args.sessions,
                                parallel_tables=args.parallel_tables, capacity_steps=args.capacity_steps,
                                changelog=args.changelog, store=store, connect=args.connect, warm_ups=args.warm_ups)
    if name == "memory":
        from cdc_apply.bench.memory import bench_memory

        return 0, bench_memory(megabytes=args.megabytes, updates=args.updates, changelog=args.changelog)
    if name == "soak":
        from cdc_apply.bench.soak import bench_soak

        return 0, bench_soak(minutes=args.minutes, rate=args.rate, sessions=args.sessions,
                             parallel_tables=args.parallel_tables)
    if name == "stream":
        from cdc_apply.bench.stream import bench_stream

        return 0, bench_stream(seconds=args.seconds, rate=args.rate, sessions=args.sessions)
    if name == "failover":
        from cdc_apply.bench.failover import bench_failover

        return 0, bench_failover(rounds=args.rounds, rate=args.rate)
    if name == "snapshot":
        from cdc_apply.bench.snapshot import bench_snapshot

        with object_store(args.warehouse, args.config) as store:
            return 0, bench_snapshot(rows=args.rows or 2_000_000, changelog=args.changelog, store=store)
    if name == "restart":
        from cdc_apply.bench.restart import bench_restart

        if args.mode not in ("follow", "stream"):
            print(f"bench restart: --mode is follow or stream, not {args.mode}", file=sys.stderr)
            return 2, None
        return 0, bench_restart(rounds=args.rounds, mode=args.mode, connect=args.connect)
    if name == "crash":
        from cdc_apply.bench.crash import bench_crash

        with object_store(args.warehouse, args.config) as store:
            result = bench_crash(mode=args.mode, kills=args.kills, seed=args.seed, store=store)
        passed = result["lost"] == result["applied_twice"] == result["problems_after_kills"] \
            == result["tables_differing"] == 0
        return (0 if passed else 1), result
    raise ValueError(f"unknown benchmark {name}")
