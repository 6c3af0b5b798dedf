"""Decode + assemble into change rows, against the rate the walsender delivers the same stream.

Workload: a 7-column table, 100-row transactions cycling insert, insert, update, delete, until
about ``messages`` pgoutput messages exist. The walsender run receives them all (timed: the
delivery rate); the decode run turns exactly those bytes into typed change rows and Arrow (timed).
Run in the ``cdc-apply`` process, so with its garbage-collector setting (``runtime.tune_gc``).
"""

from __future__ import annotations

import statistics
import time

import psycopg

from cdc_apply.assemble import Assembler
from cdc_apply.changerows.segments import ChangeRowBuilder
from cdc_apply.config import BatchingConfig
from cdc_apply.pgoutput.framing import XLogData
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.raw import RawMessage
from cdc_apply.sources.slot import PgOutputOptions, create_slot
from cdc_apply.sources.walsender import WalSenderStream

ROWS_PER_TRANSACTION = 100
BATCH_MESSAGES = BatchingConfig().max_changes  # the live pipeline's default batch

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


def bench_decode(messages: int = 500_000, binary: bool = False, rounds: int = 3) -> dict[str, float]:
    """Each stage is timed ``rounds`` times, alternating, and the medians are compared."""
    transactions = max(4, messages // (ROWS_PER_TRANSACTION + 2))
    options = PgOutputOptions(("bench_pub",), proto_version=1, binary=binary)
    timings: dict[str, list[float]] = {stage: [] for stage in STAGES}
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(WORKLOAD)
            create_slot(conn, "bench")
            print(f"generating {transactions} transactions of {ROWS_PER_TRANSACTION} rows ...", flush=True)
            conn.execute("CALL bench_load(%s)", (transactions,))
        raws: list[RawMessage] = []
        for _ in range(rounds):
            # The slot is never confirmed, so every round streams the same bytes from its start.
            seconds, raws = _delivery(server.dsn, options, transactions)
            timings["delivery"].append(seconds)
            if len(timings["delivery"]) == 1:
                _warm_up(raws[:2000])
            for stage, seconds in _decode(raws).items():
                timings[stage].append(seconds)

    total_bytes = sum(len(r.data) for r in raws)
    median = {stage: statistics.median(values) for stage, values in timings.items()}
    result: dict[str, float] = {"messages": len(raws), "megabytes": total_bytes / 1e6, "rounds": rounds}
    for stage in STAGES:
        result[f"{stage}_msg_per_s"] = len(raws) / median[stage]
    result["change_rows_mb_per_s"] = total_bytes / 1e6 / median["change_rows"]
    for stage in STAGES[1:]:
        result[f"ratio_{stage}_to_delivery"] = median["delivery"] / median[stage]
    mode = "binary" if binary else "text"
    print(f"bench decode ({mode} mode): {len(raws):,} messages, {total_bytes / 1e6:.1f} MB; "
          f"median of {rounds} rounds, batches of {BATCH_MESSAGES:,} messages")
    print(f"  {'walsender delivery':<34} {result['delivery_msg_per_s']:>10,.0f} msg/s  ({median['delivery']:.2f} s)")
    for stage, label in zip(STAGES[1:], ("decode + assemble", "... + change rows as Arrow",
                                          "... + rows as Python values"), strict=True):
        print(f"  {label:<34} {result[f'{stage}_msg_per_s']:>10,.0f} msg/s  ({median[stage]:.2f} s)  "
              f"ratio {result[f'ratio_{stage}_to_delivery']:.2f}x")
    return result


STAGES = ("delivery", "decode_assemble", "change_rows", "python_rows")


def _delivery(dsn: str, options: PgOutputOptions, transactions: int) -> tuple[float, list[RawMessage]]:
    """The walsender streams the whole workload to us; we only frame it."""
    stream = WalSenderStream(dsn, "bench", options)
    raws: list[RawMessage] = []
    commits = 0
    started = time.perf_counter()
    stream.start()
    while commits < transactions:
        for frame in stream.read(timeout=5.0):
            if isinstance(frame, XLogData):
                raws.append(RawMessage(frame.start_lsn, None, frame.payload))
                commits += frame.payload[:1] == b"C"
    seconds = time.perf_counter() - started
    stream.close()
    return seconds, raws


def _decode(raws: list[RawMessage]) -> dict[str, float]:
    batches = [raws[i:i + BATCH_MESSAGES] for i in range(0, len(raws), BATCH_MESSAGES)]
    # Decode + assemble (row images left as bytes), batch by batch as the live pipeline cuts them.
    assembler = Assembler()
    started = time.perf_counter()
    transactions = [list(assembler.transactions(batch)) for batch in batches]
    assemble_seconds = time.perf_counter() - started
    # ... + change rows as Arrow, as the Spark data source hands them over.
    builder = ChangeRowBuilder()
    started = time.perf_counter()
    rows = sum(segment.to_arrow().num_rows for batch in transactions for segment in builder.build(batch))
    arrow_seconds = time.perf_counter() - started
    # ... + those rows as Python values, as the apply's collapse reads them.
    started = time.perf_counter()
    python_rows = sum(len(segment.rows) for batch in transactions for segment in builder.build(batch))
    python_seconds = time.perf_counter() - started
    assert python_rows == rows == sum(len(t.changes) for batch in transactions for t in batch)
    return {"decode_assemble": assemble_seconds, "change_rows": assemble_seconds + arrow_seconds,
            "python_rows": assemble_seconds + python_seconds}


def _warm_up(raws: list[RawMessage]) -> None:
    """Arrow's compute kernels load on first use (about 0.3 s once per process): not per batch."""
    for segment in ChangeRowBuilder().build(Assembler().transactions(raws)):
        segment.to_arrow()
