"""Decode + assemble into change rows, against the rate the walsender delivers the same stream.

Workload: a 7-column table, 100-row transactions cycling insert, insert, update, delete, until
about ``messages`` pgoutput messages exist. The walsender run receives them all (timed: the
delivery rate), keeping each read's frames as the connection returned them; the decode run turns
exactly those frames into transactions, read by read as ``run --follow`` does (timed), both the
read-at-a-time way (``Assembler.feed_spans``, the live path) and message by message (a frame
object and a ``RawMessage`` each, the path before it), then into typed change rows and Arrow: a
read's transactions at a time, and again in batches of ``batching.max_changes`` (a backlogged
``run --follow`` builds its change rows per batch).
Run in the ``cdc-apply`` process, so with its garbage-collector setting (``runtime.tune_gc``).
"""

from __future__ import annotations

import statistics
import time

import psycopg

from cdc_apply.assemble import Assembler
from cdc_apply.bench.load import Load, create_schema
from cdc_apply.changerows.segments import ChangeRowBuilder
from cdc_apply.config import BatchingConfig
from cdc_apply.transactions import Transaction
from cdc_apply.pgoutput.framing import XLogData, decode_copy_data, split_frames
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.raw import RawMessage
from cdc_apply.sources.slot import PgOutputOptions, create_slot
from cdc_apply.sources.walsender import WalSenderStream
from cdc_apply.spark.rows import record_batches

ROWS_PER_TRANSACTION = 100
LOAD_PUBLICATION = "load"
BACKLOG_READ = 10_000  # WalSenderStream.read's max_frames

WORKLOAD = """
CREATE TABLE bench (id bigint PRIMARY KEY, account int NOT NULL, amount numeric(12,2), note text,
                    created timestamptz NOT NULL, flag boolean, score double precision);
CREATE PUBLICATION bench_pub FOR TABLE bench;
CREATE PROCEDURE bench_load(transactions int) LANGUAGE plpgsql AS $$
DECLARE next_id bigint := 0; oldest bigint := 0;
BEGIN
  FOR k IN 0 .. transactions - 1 LOOP
    IF k % 4 IN (0, 1) THEN
      INSERT INTO bench SELECT next_id + g, g % 97, g * 1.25, 'note ' || g, now(), g % 2 = 0, g / 7.0
        FROM generate_series(1, 100) g;
      next_id := next_id + 100;
    ELSIF k % 4 = 2 THEN
      UPDATE bench SET amount = amount + 1, note = note || '+' WHERE id > next_id - 100;
    ELSE
      DELETE FROM bench WHERE id > oldest AND id <= oldest + 100;
      oldest := oldest + 100;
    END IF;
    COMMIT;
  END LOOP;
END $$;
"""


def bench_decode(messages: int = 500_000, binary: bool = False, rounds: int = 3, load: bool = False) -> dict[str, float]:
    """Each stage is timed ``rounds`` times, alternating, and the medians are compared. ``load``: the
    workload of `bench e2e` and the crash drills instead (``bench/load.py``: 1-4 changes to accounts,
    a journal and a ledger row a transaction, TOAST-sized notes, savepoints rolled back, truncates),
    run as fast as it goes until it made about ``messages`` messages."""
    options = PgOutputOptions((LOAD_PUBLICATION if load else "bench_pub",), proto_version=1, binary=binary)
    timings: dict[str, list[float]] = {stage: [] for stage in (*STAGES, "split", "receive_cpu", "log_rows")}
    reads: list[list[memoryview]] = []
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            transactions = _generate_load(conn, server.dsn, messages) if load else _generate_bulk(conn, messages)
        for _ in range(rounds):
            # The slot is never confirmed, so every round streams the same bytes from its start.
            seconds, receive_cpu, frames = _delivery(server.dsn, options, transactions)
            timings["receive_cpu"].append(receive_cpu)
            # Decoded in reads of up to max_frames, as a run --follow that is behind reads them
            # (keeping pace with the walsender here, the delivery's own reads hold one or two frames).
            reads = [frames[i:i + BACKLOG_READ] for i in range(0, len(frames), BACKLOG_READ)]
            timings["delivery"].append(seconds)
            if len(timings["delivery"]) == 1:
                _warm_up(reads[:1])
            for stage, seconds in _decode(reads).items():
                timings[stage].append(seconds)

    raws = [raw for read in reads for raw in _message_by_message(read)]
    total_bytes = sum(len(r.data) for r in raws)
    median = {stage: statistics.median(values) for stage, values in timings.items()}
    result: dict[str, float] = {"messages": len(raws), "megabytes": total_bytes / 1e6, "rounds": rounds}
    for stage in STAGES:
        result[f"{stage}_msg_per_s"] = len(raws) / median[stage]
    result["change_rows_mb_per_s"] = total_bytes / 1e6 / median["change_rows"]
    for stage in STAGES[1:]:
        result[f"ratio_{stage}_to_delivery"] = median["delivery"] / median[stage]
    mode = ("binary" if binary else "text") + (" mode, the e2e load" if load else " mode")
    print(f"bench decode ({mode}): {len(raws):,} messages, {total_bytes / 1e6:.1f} MB in {len(reads):,} reads; "
          f"median of {rounds} rounds, each stage from the frames as received")
    print(f"  {'walsender delivery':<46} {result['delivery_msg_per_s']:>10,.0f} msg/s  ({median['delivery']:.2f} s)")
    for stage, label in zip(STAGES[1:], STAGE_LABELS, strict=True):
        print(f"  {label:<46} {result[f'{stage}_msg_per_s']:>10,.0f} msg/s  ({median[stage]:.2f} s)  "
              f"ratio {result[f'ratio_{stage}_to_delivery']:.2f}x")
    per_change = 1e6 / sum(1 for r in raws if r.data[:1] in (b"I", b"U", b"D"))
    print(f"  per change: assembly {median['decode_assemble'] * per_change:.2f} us read at a time, "
          f"{median['message_by_message'] * per_change:.2f} us message by message "
          f"({median['message_by_message'] / median['decode_assemble']:.2f}x); of it, the frames split "
          f"{median['split'] * per_change:.2f} us")
    stage_line = {"receive (the loop's CPU)": median["receive_cpu"], "split": median["split"],
                  "decode + assemble": median["decode_assemble"] - median["split"],
                  "the targets' change rows": median["change_rows"] - median["decode_assemble"],
                  "the log's rows": median["log_rows"],
                  "the targets' change rows in a backlog's batches": median["change_rows_batched"] - median["decode_assemble"]}
    print("  per change, stage by stage: " + ", ".join(f"{stage} {seconds * per_change:.2f} us"
                                                        for stage, seconds in stage_line.items()))
    result.update({f"us_per_change_{stage}": median[stage] * per_change for stage in ("receive_cpu", "log_rows")})
    return result


def _generate_bulk(conn: psycopg.Connection, messages: int) -> int:
    transactions = max(4, messages // (ROWS_PER_TRANSACTION + 2))
    conn.execute(WORKLOAD)
    create_slot(conn, "bench")
    print(f"generating {transactions} transactions of {ROWS_PER_TRANSACTION} rows ...", flush=True)
    conn.execute("CALL bench_load(%s)", (transactions,))
    return transactions


def _generate_load(conn: psycopg.Connection, dsn: str, messages: int) -> int:
    create_schema(conn, LOAD_PUBLICATION)
    create_slot(conn, "bench")
    print(f"running the e2e load until about {messages:,} messages ...", flush=True)
    load = Load(dsn, sessions=2, rate_per_session=None).start()
    # About 1.4 messages a change in this load (its Begin and Commit, Relation messages after truncates).
    while load.changes * 1.4 < messages and not load.errors:
        time.sleep(0.2)
    load.finish()
    return load.committed


STAGES = ("delivery", "message_by_message", "decode_assemble", "change_rows", "change_rows_batched", "python_rows")
STAGE_LABELS = ("decode + assemble, message by message (before)", "decode + assemble", "... + change rows as Arrow",
                "... the same, a backlog's batches", "... + rows as Python values")
# A backlogged run --follow cuts its batches at batching.max_changes: the change rows are built per batch.
BACKLOG_BATCH_CHANGES = BatchingConfig.model_fields["max_changes"].default


def _delivery(dsn: str, options: PgOutputOptions, transactions: int) -> tuple[float, float, list[memoryview]]:
    """The walsender streams the whole workload to us; we keep the frames as received. The seconds it
    took, and the CPU seconds of this thread meanwhile: what receiving costs the driver."""
    stream = WalSenderStream(dsn, "bench", options)
    frames: list[memoryview] = []
    commits = 0
    started, cpu_started = time.perf_counter(), time.thread_time()
    stream.start()
    while commits < transactions:
        read = stream.read_raw(timeout=5.0)
        frames += read
        commits += sum(frame[_XLOG_HEADER] == _COMMIT for frame in read if len(frame) > _XLOG_HEADER)
    seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
    stream.close()
    return seconds, cpu, frames


_XLOG_HEADER = 25  # 'w', start LSN, WAL end, send time: the message follows
_COMMIT = ord("C")


def _message_by_message(frames: list[memoryview]) -> list[RawMessage]:
    """A read's messages as the driver took them before the read-at-a-time path: a frame object and
    a ``RawMessage`` each."""
    return [RawMessage(frame.start_lsn, None, frame.payload, "walsender")
            for frame in map(decode_copy_data, frames) if type(frame) is XLogData]


def _decode(reads: list[list[memoryview]]) -> dict[str, float]:
    # Decode + assemble (row images left as bytes), read by read as the live pipeline takes them.
    assembler = Assembler()
    started = time.perf_counter()
    before = [list(assembler.transactions(_message_by_message(read))) for read in reads]
    message_seconds = time.perf_counter() - started
    started = time.perf_counter()
    spans = [split_frames(read).messages for read in reads]
    split_seconds = time.perf_counter() - started
    assembler = Assembler()
    started = time.perf_counter()
    transactions = [[e for e in assembler.feed_spans(read, "walsender") if isinstance(e, Transaction)] for read in spans]
    assemble_seconds = split_seconds + time.perf_counter() - started
    assert [len(t.changes) for batch in before for t in batch] == [len(t.changes) for batch in transactions for t in batch]
    # ... + change rows as Arrow, as the Spark data source hands them over.
    builder = ChangeRowBuilder()
    started = time.perf_counter()
    rows = sum(segment.to_arrow().num_rows for batch in transactions for segment in builder.build(batch))
    arrow_seconds = time.perf_counter() - started
    # ... the same, a batch of up to max_changes at a time, as run --follow converts a backlog's batches.
    batches = _batches([t for read in transactions for t in read], BACKLOG_BATCH_CHANGES)
    builder = ChangeRowBuilder()
    started = time.perf_counter()
    batched_rows = sum(segment.to_arrow().num_rows for batch in batches for segment in builder.build(batch))
    batched_seconds = time.perf_counter() - started
    # ... + those rows as Python values, as the apply's collapse reads them.
    started = time.perf_counter()
    python_rows = sum(len(segment.rows) for batch in transactions for segment in builder.build(batch))
    python_seconds = time.perf_counter() - started
    # The change log's rows (what `confirm_after: changelog` writes), from the same transactions.
    builder = ChangeRowBuilder()
    started = time.perf_counter()
    log_rows = sum(batch.num_rows for read in transactions for batch in record_batches(read, builder))
    log_seconds = time.perf_counter() - started
    assert python_rows == rows == batched_rows == log_rows == sum(len(t.changes) for batch in transactions for t in batch)
    return {"message_by_message": message_seconds, "split": split_seconds, "decode_assemble": assemble_seconds,
            "change_rows": assemble_seconds + arrow_seconds, "change_rows_batched": assemble_seconds + batched_seconds,
            "python_rows": assemble_seconds + python_seconds,
            "log_rows": log_seconds}


def _batches(transactions: list[Transaction], max_changes: int) -> list[list[Transaction]]:
    """Whole transactions, cut as the replication core cuts a backlog: at ``max_changes`` pending."""
    batches: list[list[Transaction]] = [[]]
    pending = 0
    for txn in transactions:
        batches[-1].append(txn)
        pending += len(txn.changes)
        if pending >= max_changes:
            batches.append([])
            pending = 0
    return [batch for batch in batches if batch]


def _warm_up(reads: list[list[memoryview]]) -> None:
    """Arrow's compute kernels load on first use (about 0.3 s once per process): not per batch."""
    for read in reads:
        for segment in ChangeRowBuilder().build(Assembler().transactions(_message_by_message(read))):
            segment.to_arrow()
