"""Capture a variant's messages from a slot through the SQL interface."""

from __future__ import annotations

import psycopg

from cdc_apply.pgserver import PgServer
from cdc_apply.sources.raw import RawMessage
from cdc_apply.sources.slot import PgOutputOptions, read_changes


def peek(server: PgServer, dbname: str, slot: str, options: PgOutputOptions, *,
         immediate_streaming: bool = False) -> list[RawMessage]:
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("SET logical_decoding_work_mem = '64kB'")
        if immediate_streaming:
            conn.execute("SET debug_logical_replication_streaming = immediate")
        return list(read_changes(conn, slot, options))
