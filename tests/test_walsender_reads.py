"""A walsender read (``WalSenderStream.read_raw``) takes what the connection holds already, not only
what libpq's input buffer holds: behind a backlog a read is thousands of frames, which the
read-at-a-time assembly takes a run at a time (``Assembler.feed_spans``: 512 messages or more)."""

from __future__ import annotations

import time

import psycopg

from cdc_apply.sources.slot import PgOutputOptions, create_slot
from cdc_apply.sources.walsender import WalSenderStream


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
