"""Decode + assemble into change rows, against the rate the walsender delivers the same stream.

Workload: a 7-column table, 100-row transactions cycling insert, insert, update, delete, until
about ``messages`` pgoutput messages exist. The walsender run receives them all (timed: the
delivery rate); the decode run turns exactly those bytes into typed change rows and Arrow (timed).
"""

from __future__ import annotations

import time

import psycopg

from cdc_apply.assemble import Assembler
from cdc_apply.changes import ChangeRowBuilder
from cdc_apply.pgoutput.framing import XLogData
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.raw import RawMessage
from cdc_apply.sources.slot import PgOutputOptions, create_slot
from cdc_apply.sources.stream import WalSenderStream

ROWS_PER_TRANSACTION = 100

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


def bench_decode(messages: int = 500_000, binary: bool = False) -> dict[str, float]:
    transactions = max(4, messages // (ROWS_PER_TRANSACTION + 2))
    options = PgOutputOptions(("bench_pub",), proto_version=1, binary=binary)
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(WORKLOAD)
            create_slot(conn, "bench")
            print(f"generating {transactions} transactions of {ROWS_PER_TRANSACTION} rows ...", flush=True)
            conn.execute("CALL bench_load(%s)", (transactions,))

        # 1. Delivery: the walsender streams the whole workload to us; we only frame it.
        stream = WalSenderStream(server.dsn, "bench", options)
        raws: list[RawMessage] = []
        commits = 0
        started = time.perf_counter()
        stream.start()
        while commits < transactions:
            for frame in stream.read(timeout=5.0):
                if isinstance(frame, XLogData):
                    raws.append(RawMessage(frame.start_lsn, None, frame.payload))
                    commits += frame.payload[:1] == b"C"
        delivery_seconds = time.perf_counter() - started
        stream.close()

    total_bytes = sum(len(r.data) for r in raws)
    # 2. Decode + assemble + typed change rows + Arrow, over exactly those bytes.
    started = time.perf_counter()
    assembler = Assembler()
    builder = ChangeRowBuilder()
    rows = 0
    for segment in builder.build(assembler.transactions(raws)):
        rows += segment.to_arrow().num_rows
    decode_seconds = time.perf_counter() - started

    started = time.perf_counter()
    decoded_only = sum(len(t.changes) for t in Assembler().transactions(raws))
    assemble_seconds = time.perf_counter() - started
    assert decoded_only == rows

    result = {
        "messages": len(raws),
        "megabytes": total_bytes / 1e6,
        "delivery_msg_per_s": len(raws) / delivery_seconds,
        "decode_assemble_msg_per_s": len(raws) / assemble_seconds,
        "change_rows_msg_per_s": len(raws) / decode_seconds,
        "change_rows_mb_per_s": total_bytes / 1e6 / decode_seconds,
    }
    result["ratio_decode_assemble_to_delivery"] = result["decode_assemble_msg_per_s"] / result["delivery_msg_per_s"]
    result["ratio_change_rows_to_delivery"] = result["change_rows_msg_per_s"] / result["delivery_msg_per_s"]
    mode = "binary" if binary else "text"
    print(f"bench decode ({mode} mode): {len(raws):,} messages, {total_bytes / 1e6:.1f} MB, {rows:,} change rows")
    print(f"  walsender delivery            {result['delivery_msg_per_s']:>12,.0f} msg/s  ({delivery_seconds:.2f} s)")
    print(f"  decode + assemble             {result['decode_assemble_msg_per_s']:>12,.0f} msg/s  "
          f"({assemble_seconds:.2f} s)  ratio {result['ratio_decode_assemble_to_delivery']:.2f}x")
    print(f"  ... + typed change rows/Arrow {result['change_rows_msg_per_s']:>12,.0f} msg/s  "
          f"({decode_seconds:.2f} s, {result['change_rows_mb_per_s']:.1f} MB/s)  "
          f"ratio {result['ratio_change_rows_to_delivery']:.2f}x")
    return result
