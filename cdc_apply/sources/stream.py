"""The walsender: START_REPLICATION ... LOGICAL over a psycopg replication connection (COPY BOTH).

This is the framing loop only; reconnects, status cadence and the pipeline come with the live source.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
from psycopg import pq

from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import datetime_to_pg_us, format_lsn
from cdc_apply.pgoutput.framing import Keepalive, XLogData, decode_copy_data, encode_standby_status
from cdc_apply.sources.slot import PgOutputOptions


class WalSenderStream:
    def __init__(self, conninfo: str, slot: str, options: PgOutputOptions, start_lsn: int = 0) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=True, replication="database")
        self.slot = slot
        self.options = options
        self.start_lsn = start_lsn

    def start(self) -> None:
        pairs = ", ".join(f"\"{key}\" '{value.replace(chr(39), chr(39) * 2)}'"
                          for key, value in self.options.as_pairs(for_walsender=True))
        command = f'START_REPLICATION SLOT "{self.slot}" LOGICAL {format_lsn(self.start_lsn)} ({pairs})'
        pgconn = self.conn.pgconn
        pgconn.send_query(command.encode())
        result = pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            message = pgconn.get_error_message() if result is None else result.get_error_message()
            raise CdcApplyError(f"START_REPLICATION on slot {self.slot} failed: {message}")

    def frames(self) -> Iterator[XLogData | Keepalive]:
        """Blocks for each frame; ends when the server ends the copy."""
        pgconn = self.conn.pgconn
        while True:
            size, data = pgconn.get_copy_data(0)
            if size == -1:
                return
            if size == -2:
                raise CdcApplyError(f"replication stream failed: {pgconn.get_error_message()}")
            yield decode_copy_data(bytes(data))

    def send_status(self, flushed_lsn: int, reply_requested: bool = False) -> None:
        from datetime import datetime, timezone

        now = datetime_to_pg_us(datetime.now(timezone.utc))
        self.conn.pgconn.put_copy_data(encode_standby_status(flushed_lsn, flushed_lsn, flushed_lsn, now,
                                                             reply_requested))
        self.conn.pgconn.flush()

    def close(self) -> None:
        self.conn.close()
