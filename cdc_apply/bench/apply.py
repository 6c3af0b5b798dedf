"""`cdc-apply bench apply`: one collapsed MERGE of mixed changes into a large Delta table, side by side
with a plain append of the same rows and with one MERGE per 100-row transaction; then batches of
new rows only, written by MERGE and by the append ``BatchApplier`` uses for them, alternating.
The second baseline is Spark's own append of the same rows from a cached DataFrame: the cost of
the data alone, with no conversion on the way. The append is timed twice: its rows staged as a
Parquet file under the table's folder (``apply/staging.py``, as the pipeline stages a frame of
``target.staging_rows`` rows or more) and sent from the driver as ``createDataFrame`` does.

Change rows are generated directly as Arrow (the decode path has its own benchmark): ``changes``
rows in 100-row transactions, 60% updates, 20% inserts, 20% deletes, over a ``rows``-row target.
The MERGE takes the path the apply takes for them, the collapse as columns (``apply/columnar.py``);
the row-by-row collapse of the same rows (``apply/collapse.py``, with their conversion to Python
values and back) is timed beside it.
"""

from __future__ import annotations

import random
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from cdc_apply.apply.collapse import Collapsed, Collapser
from cdc_apply.apply.columnar import CollapsedColumns, collapsed_columns
from cdc_apply.apply.merge import merge_collapsed, source_frame, typed_frame
from cdc_apply.apply.options import KEEP, OP, TableOptions
from cdc_apply.apply.schema import initial_columns
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.staging import NO_STAGING, pipeline_staging, staging_scope
from cdc_apply.config import DEFAULT_STAGING_ROWS
from cdc_apply.lake.state import PipelineState
from cdc_apply.apply.targets import SourceState, Target
from cdc_apply.changerows.columns import python_rows
from cdc_apply.pgtypes.sparktypes import arrow_type
from cdc_apply.spark.session import session_for

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

COLUMNS = [("id", "bigint"), ("account", "int"), ("amount", "decimal(12,2)"), ("note", "string"),
           ("created", "timestamp"), ("flag", "boolean"), ("score", "double")]
BASE_TS = 1_700_000_000_000_000


def _image(key: int, version: int) -> dict[str, Any]:
    from decimal import Decimal

    return {"id": key, "account": key % 97, "amount": Decimal(key % 100000 + version) / 100,
            "note": f"note {key} v{version}", "created": BASE_TS + key, "flag": key % 2 == 0,
            "score": key / 7.0}


def generate_changes(rows: int, changes: int, seed: int = 7) -> Iterator[dict[str, Any]]:
    """Mixed changes against keys 1..rows: updates and deletes of existing keys, inserts of new ones."""
    rng = random.Random(seed)
    next_key = rows + 1
    lsn = 1 << 32
    for n in range(changes):
        if n % 100 == 0:
            lsn += 4096
        roll = rng.random()
        base = {"commit_lsn": lsn, "commit_ts": BASE_TS + n, "xid": 1000 + n // 100, "seq": n % 100,
                "old": None, "unchanged": [], "truncate_options": None}
        if roll < 0.6:
            key = rng.randint(1, rows)
            yield base | {"op": "U", "key": {"id": key}, "new": _image(key, n)}
        elif roll < 0.8:
            yield base | {"op": "I", "key": {"id": next_key}, "new": _image(next_key, n)}
            next_key += 1
        else:
            yield base | {"op": "D", "key": {"id": rng.randint(1, rows)}, "new": None}


def insert_changes(first_key: int, count: int, lsn: int) -> Iterator[dict[str, Any]]:
    """``count`` inserts of keys from ``first_key`` on: a batch of new rows only."""
    for n in range(count):
        key = first_key + n
        yield {"commit_lsn": lsn, "commit_ts": BASE_TS + n, "xid": 9000, "seq": n, "old": None, "unchanged": [],
               "truncate_options": None, "op": "I", "key": {"id": key}, "new": _image(key, 0)}


def arrow_changes(change_rows: Iterator[dict[str, Any]], chunk: int = 100_000) -> pa.Table:
    """Change rows as Arrow, in the change-row layout the decoder gives (the columns the collapse
    reads), converted ``chunk`` rows at a time so the Python rows never all exist at once."""
    image = pa.struct([(name, arrow_type(spark_type)) for name, spark_type in COLUMNS])
    schema = pa.schema([("commit_lsn", pa.int64()), ("commit_ts", pa.timestamp("us", tz="UTC")), ("xid", pa.int64()),
                        ("seq", pa.int32()), ("op", pa.string()), ("key", pa.struct([("id", pa.int64())])),
                        ("old", image), ("new", image), ("unchanged", pa.list_(pa.string())),
                        ("truncate_options", pa.int8())])
    batches, pending = [], []
    for row in change_rows:
        pending.append(row)
        if len(pending) == chunk:
            batches.append(pa.RecordBatch.from_pylist(pending, schema=schema))
            pending = []
    if pending:
        batches.append(pa.RecordBatch.from_pylist(pending, schema=schema))
    return pa.Table.from_batches(batches, schema=schema)


def _collapsed(changes: pa.Table) -> CollapsedColumns:
    columnar = collapsed_columns(changes, None, {name: name for name, _ in COLUMNS}, ("id",), dict(COLUMNS))
    assert columnar is not None, "the generated changes take the columnar collapse"
    return columnar


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_jvm_heap_mb(spark: Any) -> float:
    management = spark._jvm.java.lang.management.ManagementFactory
    total = 0
    for pool in management.getMemoryPoolMXBeans():
        if str(pool.getType()) == "Heap memory":
            total += pool.getPeakUsage().getUsed()
    return total / 2**20


def bench_apply(rows: int, changes: int, per_transaction_slice: int, insert_batch: int = 5_000,
                insert_rounds: int = 5, spark: SparkSession | None = None, connect: bool = False) -> dict[str, float]:
    """``spark``: a session to run in (a test's), else a new one. ``connect``: the same again on a
    Spark Connect client of a local Connect server started here (the classic session's JVM idle
    meanwhile), and the two side by side."""
    sizes = (rows, changes, per_transaction_slice, insert_batch, insert_rounds)
    with session_for(spark) as spark:
        classic = _measure(spark, *sizes)
    _print(classic, *sizes, "classic session")
    if not connect:
        return classic
    from cdc_apply.spark.connect_server import ConnectServer
    from cdc_apply.spark.session import build_spark_session

    print("\nthe same on a Spark Connect session ...", flush=True)
    with ConnectServer({"spark.master": "local[2]"}) as server:
        client = build_spark_session({"spark.remote": server.url})
        try:
            on_connect = _measure(client, *sizes)
        finally:
            client.stop()
    _print(on_connect, *sizes, "Spark Connect session")
    print("\nSpark Connect ÷ classic, the same work in one run (goal <= 1.3x):")
    for key, label in (("merge_apply_s", "collapsed MERGE"), ("append_s", "plain append"), ("append_sent_s", "append, rows sent"),
                       ("per_txn_s", "one MERGE per transaction"), ("new_rows_merge_s", "new rows by MERGE"),
                       ("new_rows_append_s", "new rows appended (fastest)"),
                       ("new_rows_public_s", "new rows, public append")):
        print(f"  {label:<28} {on_connect[key]:7.2f} s ÷ {classic[key]:7.2f} s = {on_connect[key] / classic[key]:.2f}x")
    print(f"  ratio MERGE apply / append: classic {classic['merge_apply_s'] / classic['append_s']:.2f}x, "
          f"Connect {on_connect['merge_apply_s'] / on_connect['append_s']:.2f}x")
    return {**classic, **{f"connect_{key}": value for key, value in on_connect.items()}}


ROWS_PER_FILE = 250_000  # the bench target's file size, about what a copied range of pages holds


def _measure(spark: SparkSession, rows: int, changes: int, per_transaction_slice: int, insert_batch: int,
             insert_rounds: int) -> dict[str, float]:
    from cdc_apply.apply.session_kind import is_connect

    connect = is_connect(spark)
    folder = tempfile.mkdtemp(prefix="cdc_apply_bench_apply_")
    staging = pipeline_staging(PipelineState.at(folder, "bench"), DEFAULT_STAGING_ROWS)
    options = TableOptions()
    unfiltered = TableOptions(key_filter=False)  # the MERGE condition without the key filter, side by side
    try:
        def fresh_target(name: str) -> Target:
            target = Target(spark, f"{folder}/{name}", by_name=False, staging=staging)
            columns = initial_columns(COLUMNS)
            target.create(SourceState(1, "public", "bench", ("id",), columns, (0, 0)), dict(COLUMNS), options, {})
            return target

        def collapse(change_rows: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
            collapser = Collapser("public.bench", ("id",))
            for row in change_rows:
                collapser.add(row)
            return collapser.result

        print(f"building a {rows:,}-row Delta table ...", flush=True)
        target = fresh_target("target")
        started = time.perf_counter()
        (spark.range(1, rows + 1).selectExpr(
            "id", "cast(id % 97 as int) AS account", "cast((id % 100000) / 100 as decimal(12,2)) AS amount",
            "concat('note ', id) AS note", f"timestamp_micros({BASE_TS} + id) AS created", "id % 2 = 0 AS flag",
            "cast(id / 7.0 AS double) AS score", "0L AS _cdc_commit_lsn", f"timestamp_micros({BASE_TS}) AS _cdc_commit_ts")
         # laid out as the initial copy lays a table out: files of key ranges (a range of pages each)
         .repartitionByRange(max(1, rows // ROWS_PER_FILE), "id")
         .write.format("delta").mode("append").save(target.location))
        print(f"  built in {time.perf_counter() - started:.1f} s", flush=True)

        def merge(target: Target, changes: pa.Table, app_id: str, version: int, key_filter: bool = True) -> None:
            merge_collapsed(target, Collapsed(("id",)), dict(COLUMNS), ("id",),
                            options if key_filter else unfiltered, DataCommit(app_id, version, "{}"),
                            columnar=_collapsed(changes))

        warm = fresh_target("warmup")  # the first MERGE in a JVM pays a large warm-up: not timed
        merge(warm, arrow_changes(generate_changes(1000, 300)), "bench/warmup", 1)

        print(f"generating {changes:,} change rows ...", flush=True)
        change_table = arrow_changes(generate_changes(rows, changes))
        before_rss = _peak_rss_mb()
        started = time.perf_counter()
        collapsed = _collapsed(change_table)
        collapse_s = time.perf_counter() - started
        started = time.perf_counter()
        merge_collapsed(target, Collapsed(("id",)), dict(COLUMNS), ("id",), options,
                        DataCommit("bench/merge", 2, "{}"), columnar=collapsed)
        merge_s = time.perf_counter() - started
        merge_rss = _peak_rss_mb()

        def append(name: str, staged: bool) -> float:
            appended = fresh_target(name)
            started = time.perf_counter()
            with staging_scope():
                frame = typed_frame(spark, collapsed.columns, dict(COLUMNS), staging if staged else NO_STAGING)
                frame.drop(OP, KEEP).write.format("delta").mode("append").save(appended.location)
            return time.perf_counter() - started

        append_s = append("append", staged=True)
        append_sent_s = append("append_sent", staged=False)
        source = typed_frame(spark, collapsed.columns, dict(COLUMNS)).drop(OP, KEEP)

        # The cost of the data alone: the same rows appended from a DataFrame Spark already holds.
        cached = source.cache()
        cached.count()
        cached_target = fresh_target("cached_append")
        started = time.perf_counter()
        cached.write.format("delta").mode("append").save(cached_target.location)
        cached_append_s = time.perf_counter() - started
        cached.unpersist()

        # One MERGE per 100-change transaction, taking turns with the key filter on (the default) and off
        # (docs/apply.md, "What a MERGE reads"): the cost a small batch pays for the table's size.
        slice_rows = change_table.slice(0, per_transaction_slice)
        transactions = 0
        per_txn: dict[bool, list[float]] = {True: [], False: []}
        for start in range(0, slice_rows.num_rows, 100):
            transactions += 1
            filtered = transactions % 2 == 1
            started = time.perf_counter()
            merge(target, slice_rows.slice(start, 100), "bench/per-transaction", 10 + transactions, filtered)
            per_txn[filtered].append(time.perf_counter() - started)
        per_txn_s = sum(per_txn[True]) + sum(per_txn[False])

        # The row-by-row collapse of the same changes, to its MERGE source (not merged again).
        started = time.perf_counter()
        row_by_row = collapse(python_rows(change_table))
        source_frame(spark, row_by_row, dict(COLUMNS))
        row_by_row_s = time.perf_counter() - started
        assert len(row_by_row.states) == collapsed.keys_written

        print(f"{insert_rounds} rounds of {insert_batch:,} new rows: MERGE, then append, into the same table ...",
              flush=True)
        # Taking turns: MERGE; an append through Delta's internal classes (apply/delta_internal.py),
        # unchecked, on a classic session only; an append through the public writer options, checked.
        ways = ("merge", "append-public") if connect else ("merge", "append", "append-public")
        timings: dict[str, list[float]] = {way: [] for way in ways}
        next_key = rows + changes + 1  # past every generated key
        internals = target.internals
        for version in range(insert_rounds * len(ways)):
            way = ways[version % len(ways)]
            batch = collapse(list(insert_changes(next_key, insert_batch, (1 << 40) + version)))
            assert batch.new_rows_only
            next_key += insert_batch
            target.internals = internals and way != "append-public"
            started = time.perf_counter()
            # As the pipeline does: its own last commit is the log's newest, so an append need not be checked.
            commit = DataCommit("bench/new-rows", 100 + version, "{}", unwritten_at=target.log_version())
            merge_collapsed(target, batch, dict(COLUMNS), ("id",), options, commit, append=way != "merge")
            timings[way].append(time.perf_counter() - started)
        target.internals = internals
        medians = {way: statistics.median(values) for way, values in timings.items()}
        return {"collapse_s": collapse_s, "merge_s": merge_s, "merge_apply_s": collapse_s + merge_s,
                "keys": collapsed.keys_written, "append_s": append_s, "append_sent_s": append_sent_s, "cached_append_s": cached_append_s,
                "row_by_row_s": row_by_row_s, "per_txn_s": per_txn_s, "per_txn_changes": slice_rows.num_rows,
                "per_txn_filtered_median_s": statistics.median(per_txn[True]),
                "per_txn_unfiltered_median_s": statistics.median(per_txn[False] or per_txn[True]),
                "transactions": transactions, "new_rows_merge_s": medians["merge"],
                "new_rows_append_s": medians.get("append", medians["append-public"]),
                "new_rows_public_s": medians["append-public"], "internal_append": float("append" in medians),
                "before_rss_mb": before_rss, "merge_rss_mb": merge_rss,
                "row_by_row_rss_mb": _peak_rss_mb(),
                "jvm_heap_mb": float("nan") if connect else _peak_jvm_heap_mb(spark)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _print(r: dict[str, float], rows: int, changes: int, per_transaction_slice: int, insert_batch: int,
           insert_rounds: int, session: str) -> None:
    total = r["merge_apply_s"]
    per_change_txn = r["per_txn_s"] / r["per_txn_changes"]
    keys = int(r["keys"])
    print(f"\nresults (one run, same machine), {session}:")
    print(f"  collapsed MERGE of {changes:,} changes into {rows:,} rows: {total:.1f} s "
          f"(collapse as columns {r['collapse_s']:.1f} s, {keys:,} keys; MERGE {r['merge_s']:.1f} s)")
    print(f"  plain Delta append of the same {keys:,} rows:     {r['append_s']:.1f} s")
    print(f"  the same append with its rows sent from the driver, not staged: {r['append_sent_s']:.1f} s "
          f"(staging is {r['append_sent_s'] / r['append_s']:.2f}x faster)")
    print(f"  ratio MERGE apply / append:                 {total / r['append_s']:.2f}x (goal <= 3x)")
    print(f"  Spark append of the same rows from a cached DataFrame: {r['cached_append_s']:.1f} s; "
          f"ratio MERGE apply / that: {total / r['cached_append_s']:.2f}x (goal <= 6x)")
    print(f"  the row-by-row collapse of the same changes to its MERGE source: {r['row_by_row_s']:.1f} s "
          f"({r['row_by_row_s'] / r['collapse_s']:.1f}x the columnar collapse)")
    print(f"  one MERGE per 100-row transaction ({int(r['transactions'])} transactions, "
          f"{int(r['per_txn_changes']):,} changes): {r['per_txn_s']:.1f} s = {per_change_txn * 1e3:.2f} ms/change, "
          f"{per_change_txn / (total / changes):,.0f}x slower per change than batched; a MERGE's median with "
          f"the key filter {r['per_txn_filtered_median_s']:.2f} s, without {r['per_txn_unfiltered_median_s']:.2f} s "
          f"({r['per_txn_unfiltered_median_s'] / r['per_txn_filtered_median_s']:.2f}x)")
    print(f"  a batch of {insert_batch:,} new rows (median of {insert_rounds}): MERGE {r['new_rows_merge_s']:.2f} s, "
          f"append {r['new_rows_append_s']:.2f} s: the append is {r['new_rows_merge_s'] / r['new_rows_append_s']:.1f}x "
          f"faster; the public path's checked append {r['new_rows_public_s']:.2f} s "
          + (f"({r['new_rows_public_s'] / r['new_rows_append_s']:.2f}x Delta's internal unchecked one)"
             if r["internal_append"] else "(the append above: Connect has no internal one)"))
    heap = "" if r["jvm_heap_mb"] != r["jvm_heap_mb"] else f"; JVM heap {r['jvm_heap_mb']:,.0f} MB"
    print(f"  peak memory: Python driver {r['before_rss_mb']:,.0f} MB holding the change rows, {r['merge_rss_mb']:,.0f} MB "
          f"after the columnar collapse and MERGE, {r['row_by_row_rss_mb']:,.0f} MB after the row-by-row collapse{heap}")
