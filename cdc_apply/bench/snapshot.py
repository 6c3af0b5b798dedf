"""`cdc-apply bench snapshot`: the initial copy against what PostgreSQL and a plain Spark job can do.

One server, one TPC-H ``lineitem``-shaped table of ``--rows`` rows; in one run, two rounds of, one
after the other:
1. the raw read: ``COPY lineitem TO STDOUT`` read by psycopg and thrown away: the rate at which
   PostgreSQL hands the rows out;
2. the product's copy: ``Snapshotter.sync`` of a pipeline with a fresh warehouse and slot (exported
   snapshot, page ranges read and converted by Spark's tasks, Delta commits, the version), with
   the Parquet files written by the tasks (``snapshot.file_writer: tasks``, the default), then the
   same with Delta's writer (``file_writer: delta``);
3. a hand-written Spark copy: COPY as CSV, parsed by ``pyarrow.csv`` with the table's types,
   ``spark.createDataFrame`` of the Arrow table, one Delta append.

Round 1 is each copy's first in this process: cdc_apply's starts Spark's Python workers, and both
Spark copies compile the JVM's write path (the later one gains from the earlier: the hand-written
copy runs after cdc_apply's, so its round-1 ratio is the conservative one). Round 2 repeats all
three, warm: the rate a long copy runs at. Prints each one's rows/s per round, the ratios issue 31
sets goals for (product ÷ raw, product ÷ Spark) per round, and the Python driver's peak RSS during
the product's first copy (the JVM's and the Python workers' are not counted).
"""

from __future__ import annotations

import contextlib
import io
import resource
import threading
import time
from collections.abc import Callable

import psycopg

from cdc_apply.bench import scratch_directory
from cdc_apply.bench.store import ObjectStore
from cdc_apply.pgserver import PgServer

LINEITEM = """
CREATE TABLE lineitem (
    l_orderkey bigint NOT NULL, l_partkey int NOT NULL, l_suppkey int NOT NULL, l_linenumber int NOT NULL,
    l_quantity numeric(15,2) NOT NULL, l_extendedprice numeric(15,2) NOT NULL, l_discount numeric(15,2) NOT NULL,
    l_tax numeric(15,2) NOT NULL, l_returnflag char(1) NOT NULL, l_linestatus char(1) NOT NULL,
    l_shipdate date NOT NULL, l_commitdate date NOT NULL, l_receiptdate date NOT NULL,
    l_shipinstruct char(25) NOT NULL, l_shipmode char(10) NOT NULL, l_comment varchar(44) NOT NULL,
    PRIMARY KEY (l_orderkey, l_linenumber))
"""
FILL = """
INSERT INTO lineitem
SELECT g / 4, (g * 7919) %% 200000, (g * 104729) %% 10000, g %% 4,
       (g %% 50) + 1, ((g %% 50) + 1) * 901.37, (g %% 11) / 100.0, (g %% 9) / 100.0,
       (ARRAY['A', 'N', 'R'])[g %% 3 + 1], (ARRAY['F', 'O'])[g %% 2 + 1],
       date '1992-01-01' + (g %% 2500)::int, date '1992-01-31' + (g %% 2500)::int, date '1992-02-15' + (g %% 2500)::int,
       (ARRAY['DELIVER IN PERSON', 'COLLECT COD', 'NONE', 'TAKE BACK RETURN'])[g %% 4 + 1],
       (ARRAY['AIR', 'RAIL', 'SHIP', 'TRUCK', 'MAIL', 'FOB', 'REG AIR'])[g %% 7 + 1],
       left(md5(g::text), 27) || ' carefully final'
FROM generate_series(%s::bigint, %s::bigint) g
"""
FILL_STEP = 500_000
# cdc_apply's copies in every round: snapshot.file_writer tasks and delta, and with --changelog the
# tasks' copy again with the change log on (its tasks write each range's rows into the log too).
VARIANTS: dict[str, tuple[str, bool]] = {"tasks": ("tasks", False), "delta": ("delta", False), "logged": ("tasks", True),
                                         "store": ("tasks", False)}
LABELS = {"raw": "raw COPY read", "spark": "hand-written Spark copy", "tasks": "cdc_apply's copy",
          "delta": "  with Delta's writer", "logged": "  with the change log",
          "store": "  on the object store"}  # the report's lines, in order


def create_lineitem(conn: psycopg.Connection, rows: int) -> None:
    conn.execute(LINEITEM)
    for start in range(0, rows, FILL_STEP):
        conn.execute(FILL, (start, min(start + FILL_STEP, rows) - 1))
    conn.execute("VACUUM ANALYZE lineitem")


def raw_copy_read(dsn: str) -> int:
    """Rows of ``COPY lineitem TO STDOUT``, read and thrown away."""
    rows = 0
    with psycopg.connect(dsn) as conn, conn.cursor().copy("COPY lineitem TO STDOUT") as copy:
        for _ in copy:
            rows += 1
    return rows


def hand_written_spark_copy(dsn: str, spark, path: str) -> int:  # type: ignore[no-untyped-def]
    """What a data engineer writes without cdc_apply: CSV from COPY, typed by pyarrow, appended by Spark."""
    import pyarrow as pa
    from pyarrow import csv

    money = pa.decimal128(15, 2)
    types = {"l_orderkey": pa.int64(), "l_partkey": pa.int32(), "l_suppkey": pa.int32(), "l_linenumber": pa.int32(),
             "l_quantity": money, "l_extendedprice": money, "l_discount": money, "l_tax": money,
             "l_returnflag": pa.string(), "l_linestatus": pa.string(), "l_shipdate": pa.date32(),
             "l_commitdate": pa.date32(), "l_receiptdate": pa.date32(), "l_shipinstruct": pa.string(),
             "l_shipmode": pa.string(), "l_comment": pa.string()}
    buffer = io.BytesIO()
    with psycopg.connect(dsn) as conn, conn.cursor().copy("COPY lineitem TO STDOUT WITH (FORMAT csv)") as copy:
        for data in copy:
            buffer.write(data)
    buffer.seek(0)
    table = csv.read_csv(buffer, read_options=csv.ReadOptions(column_names=list(types)),
                         convert_options=csv.ConvertOptions(column_types=types))
    spark.createDataFrame(table).write.format("delta").mode("append").save(path)
    return table.num_rows


class PeakRss:
    """The process's resident set, sampled every 50 ms while open (ru_maxrss is a lifetime peak)."""

    def __init__(self) -> None:
        self.peak = 0
        self.start = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _now() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _timed(what: str, run: Callable[[], int]) -> tuple[int, float]:
    print(f"  {what} ...", flush=True)
    started = time.perf_counter()
    rows = run()
    return rows, time.perf_counter() - started


def bench_snapshot(rows: int = 2_000_000, spark=None,  # type: ignore[no-untyped-def]
                   snapshot: dict[str, object] | None = None, changelog: bool = False,
                   store: ObjectStore | None = None) -> dict[str, float]:
    """``spark``: a session to use (and leave running); None builds one and stops it at the end.
    ``snapshot``: the config's ``snapshot`` section for cdc_apply's copy (default: the defaults).
    ``changelog``: also the tasks' copy with ``changelog.enabled``, whose log must hold every row.
    ``store``: also the copy into a warehouse on that object store (``--warehouse``)."""
    from cdc_apply.changelog.log import ChangeLog
    from cdc_apply.config import parse_config
    from cdc_apply.parts import copier
    from cdc_apply.sink import TableSnapshot
    from cdc_apply.sources.preflight import ensure_publication_and_slot
    from cdc_apply.spark.session import session_for

    with PgServer() as server:
        print(f"snapshot: a lineitem-shaped table of {rows:,} rows ...", flush=True)
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            create_lineitem(conn, rows)
            conn.execute("CREATE PUBLICATION bench FOR TABLE lineitem")
            size = conn.execute("SELECT pg_size_pretty(pg_table_size('lineitem'))").fetchone()[0]  # type: ignore[index]
        warehouse = scratch_directory("cdc_apply_bench_snapshot_")
        variants = {name: variant for name, variant in VARIANTS.items()
                    if (changelog or not variant[1]) and (store is not None or name != "store")}
        configs = [{name: parse_config({"pipeline": f"bench{round_}{name}", "source": {
            "dsn": server.dsn, "slot": f"bench{round_}{name}", "publication": "bench"},
            "target": {"warehouse": store.under(f"round{round_}{name}") if name == "store" and store
                       else f"{warehouse}/round{round_}{name}"},
            "changelog": {"enabled": logged}, "snapshot": {**(snapshot or {}), "file_writer": writer},
            "spark": store.spark_conf if store else {}}) for name, (writer, logged) in variants.items()}
            for round_ in (1, 2)]
        with session_for(spark, configs[0]["tasks"].spark) as spark:
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                for config in (c for by_writer in configs for c in by_writer.values()):  # the slots exist before the
                    ensure_publication_and_slot(conn, config.source)                       # copies, as in a run
            # Warm the JVM with a small write, so neither Spark copy pays for the first one.
            spark.range(10).write.format("delta").save(f"{warehouse}/warm_up")
            times: dict[str, list[float]] = {name: [] for name in ("raw", *variants, "spark")}
            copies: list[TableSnapshot] = []
            rss = PeakRss()
            for round_, by_writer in enumerate(configs, 1):
                print(f" round {round_}:", flush=True)
                raw_rows, raw_s = _timed("raw COPY read", lambda: raw_copy_read(server.dsn))
                # cdc_apply's copies before the hand-written one, whose whole-table buffers would stay in
                # this process's resident set and be counted in the copy's peak (measured in round 1).
                product: dict[str, tuple[int, float]] = {}
                for variant, config in by_writer.items():
                    snapshotter = copier(config, spark)

                    def product_copy() -> int:
                        copied = snapshotter.sync()  # noqa: B023 - called at once, in this round
                        copies.extend(copied)
                        return sum(table.rows for table in copied)

                    with rss if round_ == 1 and variant == "tasks" else contextlib.nullcontext():
                        product[variant] = _timed(f"cdc_apply's copy, file_writer: {config.snapshot.file_writer}"
                                                 + (", with the change log" if config.changelog.enabled else ""),
                                                 product_copy)
                    if config.changelog.enabled:
                        logged = ChangeLog(spark, config).read().where("xid = 0 AND op = 'I'").count()
                        assert logged == rows, f"the change log holds {logged} rows of the copy of {rows}"
                spark_rows, spark_s = _timed("hand-written Spark copy", lambda: hand_written_spark_copy(
                    server.dsn, spark, f"{warehouse}/by_hand{round_}"))  # noqa: B023
                assert raw_rows == spark_rows == rows and all(copied == rows for copied, _ in product.values()), \
                    (raw_rows, spark_rows, product)
                for name, (_, seconds) in (("raw", (raw_rows, raw_s)), *product.items(), ("spark", (spark_rows, spark_s))):
                    times[name].append(seconds)
    method = "Spark's tasks, page ranges" if copies[0].method == "ranges" else "the driver, key order"
    first = {name: rows / seconds[0] for name, seconds in times.items()}
    warm = {name: rows / seconds[1] for name, seconds in times.items()}
    print(f"bench snapshot ({rows:,} rows, {size}); round 1 is the first copy in this process (Python workers "
          "started, the JVM's write path compiled), round 2 the same copies again")
    for name, label in LABELS.items():
        if name not in times:
            continue
        print(f"  {label:<24} {times[name][0]:7.1f} s  {first[name]:>12,.0f} rows/s   round 2: {times[name][1]:7.1f} s  "
              f"{warm[name]:>12,.0f} rows/s")
    print(f"  cdc_apply's copy: {method}; Python driver RSS: peak {rss.peak / 2**20:,.0f} MB, "
          f"{rss.start / 2**20:,.0f} MB before it (round 1)")
    for label, rates in (("round 1", first), ("round 2", warm)):
        print(f"  {label}: cdc_apply ÷ raw COPY read {rates['tasks'] / rates['raw']:.3f}x (goal >= 0.25x); "
              f"cdc_apply ÷ hand-written Spark copy {rates['tasks'] / rates['spark']:.2f}x (goal >= 3x); "
              f"files written by the tasks ÷ by Delta's writer {rates['tasks'] / rates['delta']:.2f}x"
              + (f"; with the change log ÷ without {rates['logged'] / rates['tasks']:.2f}x" if "logged" in rates else ""))
        if "store" in rates:
            print(f"  {label}: on the object store ÷ on the local disk {rates['store'] / rates['tasks']:.2f}x (goal >= "
                  f"0.5x; Delta's writer there), ÷ Delta's writer on the local disk {rates['store'] / rates['delta']:.2f}x")
    result = {"product_over_raw": warm["tasks"] / warm["raw"], "product_over_spark": warm["tasks"] / warm["spark"],
              "first_product_over_raw": first["tasks"] / first["raw"],
              "first_product_over_spark": first["tasks"] / first["spark"], "driver_peak_rss_mb": rss.peak / 2**20,
              "tasks_over_delta_writer": warm["tasks"] / warm["delta"]}
    if "logged" in warm:
        result["logged_over_tasks"] = warm["logged"] / warm["tasks"]
    if "store" in warm:
        result["store_over_local"] = warm["store"] / warm["tasks"]
    return result
