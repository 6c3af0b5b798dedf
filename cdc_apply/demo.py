"""`cdc-apply demo`: embedded PostgreSQL 18 -> a realistic workload -> pgoutput -> Delta tables via MERGE.

Nothing is pre-recorded: the demo runs the same pipeline as `cdc-apply run --follow` (slot,
initial snapshot, walsender stream, batches, confirm) while the workload runs, then prints the
Delta tables next to the source's row counts.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgserver import PgServer
from cdc_apply.replay import print_summary
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes

if TYPE_CHECKING:
    from cdc_apply.sink import RunSummary

SETUP = """
CREATE TABLE customers (id int PRIMARY KEY, name text NOT NULL, email text, notes text);
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id int, amount numeric(12,2), placed timestamptz);
CREATE PUBLICATION demo_pub FOR TABLE customers, orders;
"""
TABLES = ("customers", "orders")
EXISTING = 2  # the first statements run before the pipeline starts: the initial snapshot copies them
WORKLOAD = [
    "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com', NULL), (2, 'Grace', 'grace@example.com', NULL)",
    "INSERT INTO orders SELECT g, 1 + g % 2, g * 10.5, now() FROM generate_series(1, 5) g",
    # A TOAST value (~20 kB), then an update of another column: the big value is sent as 'unchanged'.
    "UPDATE customers SET notes = (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 600) g) WHERE id = 1",
    "UPDATE customers SET email = 'ada@lovelace.org' WHERE id = 1",
    "UPDATE customers SET id = 20 WHERE id = 2",  # an update that changes the key
    "TRUNCATE orders",
    "INSERT INTO orders VALUES (100, 1, 99.99, now())",
    "ALTER TABLE customers ADD COLUMN tier text",
    "INSERT INTO customers VALUES (3, 'Edsger', NULL, NULL, 'gold')",
    "DELETE FROM customers WHERE id = 20",
]


def capture_demo(path: str) -> int:
    """Run the demo workload on a throwaway embedded PostgreSQL and write its capture file."""
    from cdc_apply.sources.capture import write_jsonl, write_parquet

    with PgServer() as server, psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(SETUP)
        create_slot(conn, "demo")
        for statement in WORKLOAD:
            conn.execute(statement)
        raws = list(read_changes(conn, "demo", PgOutputOptions(("demo_pub",), proto_version=2, streaming="on")))
    writer = write_parquet if path.endswith(".parquet") else write_jsonl
    return writer(path, raws)


def run_demo(warehouse: str | None = None) -> None:
    """The pipeline `cdc-apply run --follow` runs, on a throwaway server: snapshot, then stream."""
    from cdc_apply.spark import build_spark_session
    from cdc_apply.config import parse_config
    from cdc_apply.live import BackgroundReplicator
    from cdc_apply.sources.slot import wait_until_caught_up

    warehouse = warehouse or tempfile.mkdtemp(prefix="cdc_apply_demo_")
    started = time.perf_counter()
    step = Steps()
    step("1/5 starting an embedded PostgreSQL 18 with wal_level=logical")
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(SETUP)
            for statement in WORKLOAD[:EXISTING]:  # rows that exist before the pipeline starts
                conn.execute(statement)
        config = parse_config({
            "pipeline": "demo", "source": {"dsn": server.dsn, "slot": "demo", "publication": "demo_pub"},
            "target": {"warehouse": warehouse}, "defaults": {"schema_policy": "evolve"},
            "batching": {"max_seconds": 1}})
        step("2/5 starting Spark with Delta Lake (a new JVM)")
        spark = build_spark_session(config.spark)
        step("3/5 starting the pipeline: slot, initial snapshot of the existing rows, walsender stream")
        pipeline = BackgroundReplicator(config, spark).start()
        pipeline.wait_for_snapshots()
        step(f"4/5 running the workload ({len(WORKLOAD) - EXISTING} statements: TOAST, a key change, a truncate, "
             "ADD COLUMN ...) while it streams")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            for statement in WORKLOAD[EXISTING:]:
                conn.execute(statement)
            wait_until_caught_up(server.dsn, "demo", timeout=300)
            summary = pipeline.finish()
            source = {table: source_rows(conn, table) for table in TABLES}

    step(f"5/5 the Delta tables under {warehouse}:")
    different = []
    for table in TABLES:
        path = f"{warehouse}/public/{table}"
        frame = spark.read.format("delta").load(path).orderBy("id")
        print(f"\n== public.{table} in Delta ({path})")
        frame.show(truncate=40)
        columns, rows = source[table]
        delta = [tuple(_utc(value) for value in row) for row in frame.select(*columns).collect()]
        equal = delta == rows
        print(f"   PostgreSQL has {len(rows)} rows, Delta has {len(delta)}: "
              f"{'equal, value by value' if equal else 'DIFFERENT'}")
        if not equal:
            different.append(f"public.{table}")
    step.done()
    print("run summary:")
    for copied in summary.snapshots:
        print(f"  snapshot {copied.table}: {copied.rows} rows at {format_lsn(copied.consistent_lsn)}")
    print_summary(summary.batches, sys.stdout)
    print_first_batch_apart(summary)
    print(f"  total {time.perf_counter() - started:.1f} s; the steps: {step.report()}")
    print("  These are a demo's figures: a few transactions, the JVM's first MERGE and compiling included. "
          "For the pipeline's speed, see `cdc-apply bench e2e` (README, \"Speed\").")
    spark.stop()
    if different:
        raise CdcApplyError(f"the Delta tables {', '.join(different)} differ from PostgreSQL's under {warehouse}")


def source_rows(conn: psycopg.Connection, table: str) -> tuple[list[str], list[tuple[object, ...]]]:
    """A source table's column names and rows in key order, timestamps as naive UTC."""
    cursor = conn.execute(f"SELECT * FROM {table} ORDER BY id")
    columns = [column.name for column in cursor.description or []]
    return columns, [tuple(_utc(value) for value in row) for row in cursor.fetchall()]


def _utc(value: object) -> object:
    """A timestamp as naive UTC: PostgreSQL's are aware, Spark's naive in this process's time zone."""
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return value


class Steps:
    """Prints each step as it starts, and how long each took."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None

    def __call__(self, what: str) -> None:
        self.done()
        print(f"{what} ...", flush=True)
        self._current = (what.split(" ", 1)[0], time.perf_counter())

    def done(self) -> None:
        if self._current is not None:
            label, since = self._current
            self.taken.append((label, time.perf_counter() - since))
            self._current = None

    def report(self) -> str:
        return ", ".join(f"{label} {seconds:.1f} s" for label, seconds in self.taken)


def print_first_batch_apart(summary: RunSummary) -> None:
    """The first batch pays for a new JVM's first MERGE (compiling, the Delta log's first read): its
    figures apart from the rest, which are what a running pipeline shows."""
    batches = summary.batches
    if not batches or not summary.lag_seconds:
        return
    first = batches[0].transactions
    lags_first, lags_rest = summary.lag_seconds[:first], summary.lag_seconds[first:]
    print(f"  first batch (a new JVM's first writes): {batches[0].transactions} transaction(s) in "
          f"{batches[0].seconds:.1f} s, lag commit -> Delta up to {max(lags_first):.2f} s")
    if lags_rest:
        print(f"  later batches: {len(batches) - 1}, {sum(b.seconds for b in batches[1:]):.1f} s in all; lag commit -> "
              f"Delta p50 {summary.lag_percentile(0.5, lags_rest):.2f} s, "
              f"p99 {summary.lag_percentile(0.99, lags_rest):.2f} s")
