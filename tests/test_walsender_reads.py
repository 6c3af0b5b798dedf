"""A walsender read (``WalSenderStream.read_raw``) takes what the connection holds already, not only
what libpq's input buffer holds: behind a backlog a read is thousands of frames, which the
read-at-a-time assembly takes a run at a time (``Assembler.feed_spans``: 512 messages or more)."""

from __future__ import annotations

import time

import psycopg

from cdc_apply.config import parse_config
from cdc_apply.live import MIN_READ_FRAMES, BackgroundReplicator
from cdc_apply.pipeline import drain
from cdc_apply.sources.slot import PgOutputOptions, create_slot, wait_until_caught_up
from cdc_apply.sources.walsender import WalSenderStream
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows


def test_a_read_behind_a_backlog_takes_more_than_libpq_s_buffer(db18) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE backlog (id int PRIMARY KEY, note text)")
        conn.execute("CREATE PUBLICATION backlog_pub FOR TABLE backlog")
        create_slot(conn, "reads")
        for batch in range(20):
            conn.execute("INSERT INTO backlog SELECT g, 'note ' || g FROM generate_series(%s::int, %s::int) g",
                         (batch * 200 + 1, batch * 200 + 200))
    stream = WalSenderStream(conninfo, "reads", PgOutputOptions(("backlog_pub",), proto_version=1))
    stream.start()
    try:
        time.sleep(1.0)  # the walsender fills the socket while nobody reads
        first = stream.read_raw(timeout=5.0)
        inserts = sum(frame[25] == ord("I") for frame in first if len(frame) > 25)
        # libpq's input buffer holds a few hundred of these frames (about 60 bytes each): the read
        # went on past its refills.
        assert len(first) > 1500 and sum(map(len, first)) > 64 * 1024, len(first)
        while inserts < 4000:
            read = stream.read_raw(timeout=5.0)
            assert read, f"the stream ended after {inserts} of 4,000 inserts"
            inserts += sum(frame[25] == ord("I") for frame in read if len(frame) > 25)
        assert inserts == 4000
    finally:
        stream.close()


def test_a_live_catch_up_cuts_its_batches_at_max_changes(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A read behind a backlog takes at most the pending batch's room, and never less than
    # MIN_READ_FRAMES (LiveReplicator._receive): without that cap one read of 10,000 frames brought
    # all 3,000 transactions into one batch.
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    config = parse_config({"pipeline": "cut", "source": {"dsn": conninfo, "slot": "cut", "publication": "cut_pub"},
                           "target": {"warehouse": str(tmp_path / "wh")},
                           "batching": {"max_changes": 1000, "max_seconds": 60}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE cut (id int PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION cut_pub FOR TABLE cut")
        drain(config, spark)  # the slot and the empty copy
        conn.execute("DO $$ BEGIN FOR i IN 1..3000 LOOP INSERT INTO cut VALUES (i); COMMIT; END LOOP; END $$")
        with BackgroundReplicator(config, spark) as follower:
            wait_until_caught_up(conninfo, "cut", timeout=300)
        sizes = [batch.transactions for batch in follower.replicator.summary.batches]
        assert sum(sizes) == 3000 and max(sizes) <= 1000 + MIN_READ_FRAMES, sizes
        # Every row, read by Spark and by delta-rs (delta_rows), equal to PostgreSQL's.
        assert delta_rows(spark, str(tmp_path / "wh" / "public" / "cut"), ["id"], source_types(conn, "public.cut")) == \
            postgres_rows(conn, "public.cut", ["id"])
