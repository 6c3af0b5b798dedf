"""`cdc-apply` verbs. Each verb is a thin shell over a library function.

Exit codes: 0 success, 1 runtime failure (bad input, server error), 2 usage or config error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.config import ConfigError
from cdc_apply.errors import CdcApplyError
from cdc_apply.logs import configure as configure_logging
from cdc_apply.logs import redact
from cdc_apply.lsn import format_lsn
from cdc_apply.runtime import tune_gc

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_apply.config import Config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def _spark_session(config: Config) -> SparkSession:
    """The verbs' session. None reads ``format("pgoutput")`` but `stream`, which registers it itself:
    registering it here would cost each job's start a Python worker (``build_spark_session``). An
    object-store warehouse is checked first: a missing bucket or refused credentials fail at once."""
    from cdc_apply.apply.options import apply_options
    from cdc_apply.spark import build_spark_session

    options = apply_options(config)  # a warehouse the store refuses fails before Spark starts
    options.storage.check(options.warehouse_location, "target.warehouse")
    return build_spark_session(config.spark, register_pgoutput=False)


def _cmd_setup(args: argparse.Namespace) -> int:
    from cdc_apply.spark.jars import cache_dir, resolve_jars
    from cdc_apply.spark.jvm import archive_path, build_class_archive

    jars = resolve_jars()
    print(f"Delta jars ready: {len(jars)} files in {cache_dir()}")
    if archive_path().exists():
        print(f"JVM class archive ready: {archive_path()}")
        return EXIT_OK
    started = time.monotonic()
    try:
        archive = build_class_archive()
        print(f"JVM class archive written in {time.monotonic() - started:.0f} s: {archive}")
    except RuntimeError as exc:  # only a slower start: not a reason to fail the setup
        print(f"warning: {exc}; Spark starts without it", file=sys.stderr)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from cdc_apply.demo import run_demo

    run_demo(warehouse=args.warehouse)
    return EXIT_OK


def _cmd_decode(args: argparse.Namespace) -> int:
    from cdc_apply.decode_cli import run_decode

    return run_decode(args.captures, changes=args.changes, out=sys.stdout)


def _cmd_validate(args: argparse.Namespace) -> int:
    from cdc_apply.config import load_config

    config = load_config(args.config)
    print(f"{args.config}: valid (pipeline {config.pipeline!r}, warehouse {config.target.warehouse!r}, "
          f"{len(config.tables)} table rule(s))")
    return EXIT_OK


def _cmd_replay(args: argparse.Namespace) -> int:
    from cdc_apply.apply.options import apply_options
    from cdc_apply.config import Config, load_config
    from cdc_apply.replay import print_summary, replay

    if bool(args.captures) == args.changelog:
        raise ConfigError("replay: give capture files, or --changelog (with --config), not both")
    if args.changelog and not args.config:
        raise ConfigError("replay --changelog: --config names the pipeline and its change log")
    if not args.changelog and (args.table or args.until_lsn):
        raise ConfigError("replay: --table and --until-lsn go with --changelog")
    config = load_config(args.config) if args.config else Config()
    options = apply_options(config)
    if args.warehouse:
        from dataclasses import replace

        options = replace(options, warehouse=args.warehouse)
    spark = _spark_session(config)
    max_changes = args.max_changes or config.batching.max_changes
    if args.changelog:
        from cdc_apply.lsn import parse_lsn
        from cdc_apply.replay import replay_changelog

        try:
            until_lsn = parse_lsn(args.until_lsn) if args.until_lsn else None
        except ValueError as exc:
            raise ConfigError(f"replay --until-lsn: {exc}") from None
        results = replay_changelog(spark, config, options, table=args.table, max_changes=max_changes,
                                   until_lsn=until_lsn)
    else:
        results = replay(spark, args.captures, options, max_changes=max_changes,
                         spill_bytes=config.batching.spill_bytes)
    print_summary(results, sys.stdout)
    return EXIT_OK


def _cmd_trim_changelog(args: argparse.Namespace) -> int:
    from cdc_apply.changelog.log import ChangeLog
    from cdc_apply.apply.options import apply_options
    from cdc_apply.lake.state import AppliedPosition
    from cdc_apply.config import load_config
    from cdc_apply.lsn import parse_lsn

    if (args.through_lsn is None) == (args.older_than_days is None):
        raise ConfigError("trim-changelog: give --through-lsn or --older-than-days, one of them")
    try:
        through = parse_lsn(args.through_lsn) if args.through_lsn else None
    except ValueError as exc:
        raise ConfigError(f"trim-changelog --through-lsn: {exc}") from None
    config = load_config(args.config)
    if not config.changelog.enabled:
        raise ConfigError(f"{args.config}: changelog.enabled is false: there is no change log to trim")
    changelog = ChangeLog(_spark_session(config), config)
    if through is None:
        through = changelog.last_lsn_committed_before(time.time() - args.older_than_days * 86400)
    if through is None:
        print("trim-changelog: no transaction in the change log is old enough; nothing removed")
        return EXIT_OK
    if config.changelog.confirm_after == "changelog":
        applied = AppliedPosition(apply_options(config).state).read()
        if applied is None or applied < through:  # the targets still need those rows
            print(f"trim-changelog: the targets hold the log only up to "
                  f"{'nothing' if applied is None else format_lsn(applied)}; trimming through that instead")
            if applied is None:
                return EXIT_OK
            through = applied
    removed = changelog.trim(through)
    print(f"trim-changelog: {removed:,} rows of transactions committed through {format_lsn(through)} removed from "
          f"{changelog.target.location}; their files go at its next VACUUM")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from cdc_apply.apply.fence import clean_stops
    from cdc_apply.apply.options import apply_options
    from cdc_apply.config import load_config
    from cdc_apply.pipeline import drain
    from cdc_apply.runtime import StopFlag
    from cdc_apply.replay import print_summary

    config = load_config(args.config)
    spark = _spark_session(config)
    with StopFlag().on_signals() as stop, clean_stops(spark, apply_options(config).state):
        if args.follow:
            from cdc_apply.live import follow

            summary = follow(config, spark, stop)
        else:
            summary = drain(config, spark, stop=stop)
    for copied in summary.snapshots:
        print(f"snapshot {copied.table}: {copied.rows} rows at {format_lsn(copied.consistent_lsn)} "
              f"in {copied.seconds:.1f} s")
    print_summary(summary.batches, sys.stdout)
    if summary.lag_seconds:
        print(f"lag commit -> Delta: p50 {summary.lag_percentile(0.5):.2f} s, "
              f"p99 {summary.lag_percentile(0.99):.2f} s; reconnects {summary.reconnects}")
    confirmed = summary.confirmed_lsn
    print(f"slot {config.source.slot} confirmed to {format_lsn(confirmed) if confirmed else '(unchanged)'}")
    return EXIT_OK


def _cmd_stream(args: argparse.Namespace) -> int:
    from cdc_apply.config import load_config
    from cdc_apply.runtime import StopFlag
    from cdc_apply.stream_job import offset_lsn, run_stream

    config = load_config(args.config)
    spark = _spark_session(config)
    with StopFlag().on_signals() as stop:
        batches = run_stream(config, spark, stop)
    for progress in batches:
        source = progress["sources"][0]
        print(f"batch {progress['batchId']}: {progress['numInputRows']} change rows in "
              f"{progress['batchDuration'] / 1000:.1f} s, LSN {offset_lsn(source['startOffset'])}"
              f"..{offset_lsn(source['endOffset'])}")
    return EXIT_OK


def _cmd_follow_changelog(args: argparse.Namespace) -> int:
    from cdc_apply.follow_changelog import follow_changelog
    from cdc_apply.config import load_config
    from cdc_apply.runtime import StopFlag

    config = load_config(args.config)
    spark = _spark_session(config)
    with StopFlag().on_signals() as stop:
        summary = follow_changelog(config, spark, stop, once=args.once)
    lasts = [result.last_lsn for result in summary.batches if result.last_lsn is not None]
    print(f"follow-changelog: {len(summary.batches)} window(s), {sum(r.changes for r in summary.batches):,} changes "
          f"applied{f', the last committed at {format_lsn(lasts[-1])}' if lasts else ''}; p99 commit -> target lag "
          f"{summary.lag_percentile(0.99) or 0:.1f} s")
    return EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    from cdc_apply.config import load_config
    from cdc_apply.status import pipeline_status, watch

    config = load_config(args.config)
    if args.watch:
        try:
            watch(config, refreshes=args.refreshes)
        except KeyboardInterrupt:
            pass
        return EXIT_OK
    status = pipeline_status(config)
    print(json.dumps(status, indent=1))
    return EXIT_OK if status["slot"]["exists"] else EXIT_FAILURE


def _cmd_resync(args: argparse.Namespace) -> int:
    from cdc_apply.config import load_config
    from cdc_apply.resync import published_oids, resync

    if not args.all and not args.table:
        print("cdc-apply resync: give --table schema.table (repeatable) or --all", file=sys.stderr)
        return EXIT_USAGE
    config = load_config(args.config)
    oids = published_oids(config, None if args.all else args.table)  # a wrong name fails before Spark starts
    copied = resync(config, _spark_session(config), oids)
    for table in copied:
        print(f"resync {table.table}: {table.rows} rows at {format_lsn(table.consistent_lsn)} in {table.seconds:.1f} s")
    return EXIT_OK


def _cmd_capture(args: argparse.Namespace) -> int:
    from cdc_apply.config import load_config
    from cdc_apply.pipeline import capture

    count, manifest = capture(load_config(args.config), args.out, consume=args.consume)
    print(f"wrote {count} messages to {args.out} ({manifest})")
    return EXIT_OK


def _cmd_connect_server(args: argparse.Namespace) -> int:
    from cdc_apply.config import load_config
    from cdc_apply.spark.connect_server import ConnectServer

    overrides = {k: v for k, v in load_config(args.config).spark.items() if k != "spark.remote"} if args.config else {}
    server = ConnectServer(overrides, port=args.port).start()
    print(f"Spark Connect server at {server.url} (log: {server.log}); stop with Ctrl-C", flush=True)
    try:
        while server.running():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    from cdc_apply.bench import run_bench

    return run_bench(args.benchmark, args)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc-apply", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="log lines as text or one JSON object per line (passwords are always redacted)")
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    verb("setup", _cmd_setup, "resolve and cache the Delta Lake jars (network needed once) and write the "
                              "JVM class archive that makes Spark start faster")

    demo = verb("demo", _cmd_demo, "embedded PostgreSQL 18 -> workload -> Delta tables, printed")
    demo.add_argument("--warehouse", default=None, help="Delta warehouse directory (default: a temp dir)")

    decode = verb("decode", _cmd_decode, "print the pgoutput messages of capture files as JSON lines")
    decode.add_argument("captures", nargs="+", help="capture files (.jsonl or .parquet)")
    decode.add_argument("--changes", action="store_true", help="print change rows instead of messages")

    replay = verb("replay", _cmd_replay, "apply capture files, or the change log, to Delta tables (idempotent)")
    replay.add_argument("captures", nargs="*", help="capture files (.jsonl or .parquet), in stream order")
    replay.add_argument("--changelog", action="store_true",
                        help="replay the pipeline's change log (changelog.enabled) instead of capture files")
    replay.add_argument("--table", help="with --changelog: only this table (schema.table)")
    replay.add_argument("--until-lsn", help="with --changelog: only transactions committed up to this LSN (X/Y)")
    replay.add_argument("--warehouse", help="Delta warehouse directory (overrides target.warehouse)")
    replay.add_argument("--config", help="YAML config (tables, batching, spark)")
    replay.add_argument("--max-changes", type=int, default=None,
                        help="cut batches after this many changes (default: batching.max_changes)")

    trim = verb("trim-changelog", _cmd_trim_changelog, "the change log's retention: remove the rows of old "
                "transactions, recording how far, so that a replay needing them is refused")
    trim.add_argument("--config", required=True, help="YAML config (the pipeline and its change log)")
    trim.add_argument("--through-lsn", help="remove transactions committed at or before this LSN (X/Y)")
    trim.add_argument("--older-than-days", type=float, help="remove transactions committed more than N days ago")

    run = verb("run", _cmd_run, "apply a slot's changes to Delta, then confirm them")
    run.add_argument("--config", required=True, help="YAML config")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="take what the slot holds now and exit (default)")
    mode.add_argument("--follow", action="store_true",
                      help="stream from the walsender until SIGTERM/SIGINT (batches by batching.max_changes "
                           "or batching.max_seconds)")

    stream = verb("stream", _cmd_stream, "a Structured Streaming query: format(\"pgoutput\") -> foreachBatch -> Delta")
    stream.add_argument("--config", required=True, help="YAML config file")
    follow = verb("follow-changelog", _cmd_follow_changelog,
                  "keep the targets current from the change log: a Structured Streaming query over it "
                  "(changelog.targets: separate)")
    follow.add_argument("--config", required=True, help="YAML config file")
    follow.add_argument("--once", action="store_true", help="apply what the log holds now, then exit")
    connect = verb("connect-server", _cmd_connect_server, "run Spark's own Spark Connect server with Delta and "
                   "cdc_apply's session defaults in the foreground (docs/spark.md)")
    connect.add_argument("--port", type=int, default=15002, help="the gRPC port (default 15002)")
    connect.add_argument("--config", help="YAML config: its spark section configures the server")
    status = verb("status", _cmd_status, "the slot's health and each table's applied position, as JSON "
                                         "(exit 1 when the slot does not exist)")
    status.add_argument("--config", required=True, help="YAML config")
    status.add_argument("--watch", action="store_true",
                        help="redraw in the terminal every second (rates and lag from metrics.port when set)")
    status.add_argument("--refreshes", type=int, default=None, help="--watch: stop after this many redraws")

    resync = verb("resync", _cmd_resync, "copy tables again from a new snapshot; the slot keeps its position "
                                         "(stop the running pipeline first)")
    resync.add_argument("--config", required=True, help="YAML config")
    which = resync.add_mutually_exclusive_group()
    which.add_argument("--table", action="append", metavar="SCHEMA.TABLE", help="a published table (repeatable)")
    which.add_argument("--all", action="store_true", help="every published table (after an invalidated slot)")

    capture = verb("capture", _cmd_capture, "write a slot's changes to a capture file (.jsonl or .parquet)")
    capture.add_argument("--config", required=True, help="YAML config")
    capture.add_argument("--out", required=True, help="capture file; manifest.json is written beside it")
    capture.add_argument("--consume", action="store_true", help="advance the slot past what was written")

    validate = verb("validate", _cmd_validate, "check a YAML config and exit")
    validate.add_argument("config", help="YAML config file")

    bench = verb("bench", _cmd_bench, "benchmarks that report side-by-side ratios")
    bench.add_argument("benchmark", choices=["decode", "apply", "e2e", "stream", "soak", "memory", "failover", "snapshot", "crash", "restart"], help="which benchmark")
    bench.add_argument("--messages", type=int, default=500_000, help="decode: messages to generate")
    bench.add_argument("--binary", action="store_true", help="decode: capture with binary=true")
    bench.add_argument("--load", action="store_true",
                       help="decode: the e2e load's small transactions over four tables instead of 100-row ones")
    bench.add_argument("--rounds", type=int, default=3, help="decode: timed rounds per stage (medians compared); failover: failovers in a row; "
                            "restart: restarts")
    bench.add_argument("--rows", type=int, default=None,
                       help="apply: rows in the target table (default 10,000,000); snapshot: rows of the "
                            "lineitem-shaped table (default 2,000,000)")
    bench.add_argument("--changes", type=int, default=1_000_000, help="apply: mixed changes to merge")
    bench.add_argument("--per-transaction-slice", type=int, default=2_000,
                       help="apply: changes applied as one MERGE per 100-row transaction, for comparison")
    bench.add_argument("--seconds", type=float, default=30.0, help="e2e, stream: length of each load phase")
    bench.add_argument("--rate", type=float, default=50.0, help="e2e, stream, soak, failover: steady transactions/s per session")
    bench.add_argument("--sessions", type=int, default=2, help="e2e, soak: concurrent load sessions")
    bench.add_argument("--parallel-tables", type=int, default=4, help="e2e, soak: batching.parallel_tables")
    bench.add_argument("--minutes", type=float, default=30.0, help="soak: length of the steady load")
    bench.add_argument("--megabytes", type=float, default=1024.0, help="memory: row data in the one large transaction")
    bench.add_argument("--capacity-steps", type=int, default=4,
                       help="e2e: steady rates tried, doubling from --rate, for the capacity search (0: none)")
    bench.add_argument("--warm-ups", type=_at_least_one, default=1,
                       help="e2e: runs of the steady load before the measured one in each new JVM, the classic "
                            "session's and (--connect) the Connect server's (default 1)")
    bench.add_argument("--changelog", action="store_true",
                       help="e2e: the steady load and a backlog again with changelog.confirm_after: changelog, "
                            "side by side; memory: the run with confirm_after: changelog; snapshot: the tasks' copy "
                            "again with the change log on")
    bench.add_argument("--updates", action="store_true",
                       help="memory: the transaction updates every row of a copied table and deletes a tenth")
    bench.add_argument("--mode", choices=["follow", "stream", "changelog"], default="follow",
                       help="crash: run --follow, stream, or run --follow with changelog.confirm_after: changelog; "
                            "restart: follow or stream")
    bench.add_argument("--connect", action="store_true",
                       help="restart, apply, e2e: also as Spark Connect clients of a server started for the run, "
                            "side by side")
    bench.add_argument("--kills", type=int, default=20, help="crash: random kill -9s, after the mode's failpoint kills")
    bench.add_argument("--seed", type=int, default=7, help="crash: the random kill points' seed")
    bench.add_argument("--warehouse", default=None,
                       help="snapshot, e2e: an object-store warehouse measured beside the local disk in the same run "
                            "(crash: the drill's warehouse there instead): "
                            "a URI (s3a://bucket/path, reached with the spark: section of --config or the AWS default "
                            "chain), or local-s3 (a versitygw server the bench starts on this machine)")
    bench.add_argument("--report", default=None, metavar="FILE",
                       help="write the figures as a JSON report (the arguments, the goals, the machine, the date, "
                            "the commit; docs/benchmarks.md)")
    bench.add_argument("--config", default=None,
                       help="snapshot, e2e, crash: a config whose spark: section reaches --warehouse")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.log_format)
    tune_gc()
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"cdc-apply: config error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except CdcApplyError as exc:
        print(f"cdc-apply: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except psycopg.Error as exc:  # a server or connection problem no layer below could name better
        print(f"cdc-apply: error: PostgreSQL: {redact(str(exc).strip())}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
