"""`cdc-apply` verbs. Each verb is a thin shell over a library function.

Exit codes: 0 success, 1 runtime failure (bad input, server error), 2 usage or config error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from cdc_apply.errors import CdcApplyError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def _cmd_setup(args: argparse.Namespace) -> int:
    from cdc_apply.apply.jars import cache_dir, resolve_jars

    jars = resolve_jars()
    print(f"Delta jars ready: {len(jars)} files in {cache_dir()}")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from cdc_apply.demo import run_demo

    run_demo(warehouse=args.warehouse)
    return EXIT_OK


def _cmd_decode(args: argparse.Namespace) -> int:
    from cdc_apply.decode_cli import run_decode

    return run_decode(args.captures, changes=args.changes, out=sys.stdout)


def _cmd_bench(args: argparse.Namespace) -> int:
    from cdc_apply.bench import run_bench

    return run_bench(args.benchmark, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc-apply", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    verb("setup", _cmd_setup, "resolve and cache the Delta Lake jars (network needed once)")

    demo = verb("demo", _cmd_demo, "embedded PostgreSQL 18 -> workload -> Delta tables, printed")
    demo.add_argument("--warehouse", default=None, help="Delta warehouse directory (default: a temp dir)")

    decode = verb("decode", _cmd_decode, "print the pgoutput messages of capture files as JSON lines")
    decode.add_argument("captures", nargs="+", help="capture files (.jsonl or .parquet)")
    decode.add_argument("--changes", action="store_true", help="print change rows instead of messages")

    bench = verb("bench", _cmd_bench, "benchmarks that report side-by-side ratios")
    bench.add_argument("benchmark", choices=["decode"], help="which benchmark")
    bench.add_argument("--messages", type=int, default=500_000, help="decode: messages to generate")
    bench.add_argument("--binary", action="store_true", help="decode: capture with binary=true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args))
    except CdcApplyError as exc:
        print(f"cdc-apply: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
