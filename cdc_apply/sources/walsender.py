"""The walsender: START_REPLICATION ... LOGICAL over a psycopg replication connection (COPY BOTH).

``WalSenderStream`` reads frames without blocking past a deadline, answers keepalives that ask
for a reply, and sends standby status updates. What to confirm is the caller's decision
(``cdc_apply.live``): this module never reports a flush position on its own.

A stalled connection (a partition, a frozen server, a proxy that stops forwarding without closing)
is noticed here: every status update asks the server for a reply, so a healthy stream is never
silent for long. ``read`` raises ``StreamLost`` once nothing has arrived for ``stall_seconds``.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from datetime import datetime, timezone

import psycopg
from psycopg import pq

from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import datetime_to_pg_us, format_lsn
from cdc_apply.pgoutput.framing import (
    Keepalive, ReceivedFrames, XLogData, decode_copy_data, encode_standby_status, split_frames,
)
from cdc_apply.sources.slot import PgOutputOptions

Frame = XLogData | Keepalive
START_TIMEOUT_S = 30.0  # for the server to answer START_REPLICATION
MAX_READ_FRAMES = 10_000  # at most per read, by default
GATHER_SECONDS = 0.02  # how long a read goes on taking frames the socket holds already (a backlog: thousands)
STALL_INTERVALS = 3  # status intervals without any message from the server before a stream is stalled


class StreamLost(CdcApplyError):
    """The replication connection ended or failed; the caller reconnects."""


def start_replication_command(slot: str, options: PgOutputOptions, start_lsn: int) -> str:
    pairs = ", ".join(f"\"{key}\" '{value.replace(chr(39), chr(39) * 2)}'"
                      for key, value in options.as_pairs(for_walsender=True))
    return f'START_REPLICATION SLOT "{slot.replace(chr(34), chr(34) * 2)}" LOGICAL {format_lsn(start_lsn)} ({pairs})'


class WalSenderStream:
    """One replication connection in COPY BOTH mode.

    ``start_lsn = 0`` lets the server start at the slot's confirmed position.
    """

    def __init__(self, conninfo: str, slot: str, options: PgOutputOptions, start_lsn: int = 0,
                 connect_timeout: int = 10, on_status: Callable[[], None] | None = None,
                 stall_seconds: float | None = None) -> None:
        """``on_status`` is called after every status update sent (the metrics' liveness beat);
        ``stall_seconds``: how long the server may stay silent before the stream counts as lost."""
        try:
            self.conn = psycopg.connect(conninfo, autocommit=True, replication="database",
                                        connect_timeout=connect_timeout)
        except psycopg.OperationalError as exc:
            raise StreamLost(f"cannot open a replication connection: {exc}") from None
        self.slot = slot
        self.options = options
        self.start_lsn = start_lsn
        self.received_lsn = start_lsn  # highest WAL position seen in XLogData or a keepalive
        self.last_status_at = 0.0
        self.on_status = on_status
        self.stall_seconds = stall_seconds
        self.last_heard_at = time.monotonic()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Send START_REPLICATION and wait, without holding the GIL, for the server to enter COPY BOTH."""
        pgconn = self.conn.pgconn
        deadline = time.monotonic() + timeout
        try:
            pgconn.send_query(start_replication_command(self.slot, self.options, self.start_lsn).encode())
            while pgconn.flush():
                self._wait(deadline, for_write=True)
            pgconn.consume_input()
            while pgconn.is_busy():
                self._wait(deadline, for_write=False)
                pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise StreamLost(f"replication connection lost: {exc}") from None
        result = pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            message = pgconn.get_error_message() if result is None else result.get_error_message()
            raise CdcApplyError(f"START_REPLICATION on slot {self.slot} failed: "
                                f"{message.decode(errors='replace') if isinstance(message, bytes) else message}")

    def _wait(self, deadline: float, *, for_write: bool) -> None:
        socket = self.conn.pgconn.socket
        remaining = deadline - time.monotonic()
        ready = select.select([], [socket], [], max(remaining, 0))[1] if for_write else \
            select.select([socket], [], [], max(remaining, 0))[0]
        if not ready and remaining <= 0:
            raise StreamLost(f"START_REPLICATION on slot {self.slot} got no answer in time: the connection is stalled")

    def read(self, timeout: float, max_frames: int = MAX_READ_FRAMES) -> list[Frame]:
        """The frames that arrive within ``timeout`` seconds (returns as soon as some are in)."""
        frames = [decode_copy_data(data) for data in self.read_raw(timeout, max_frames)]
        if frames:
            self.received_lsn = max(self.received_lsn, max(frame.wal_end if type(frame) is Keepalive
                                                           else frame.start_lsn for frame in frames))
        return frames

    def read_frames(self, timeout: float, max_frames: int = MAX_READ_FRAMES) -> ReceivedFrames:
        """As ``read``, the frames kept as one buffer (``split_frames``): no object per frame."""
        received = split_frames(self.read_raw(timeout, max_frames))
        self.received_lsn = max(self.received_lsn, received.wal_end)
        return received

    def read_raw(self, timeout: float, max_frames: int = MAX_READ_FRAMES) -> list[memoryview]:
        """The CopyData frames as the connection returns them: each is its own buffer, valid after
        the next call."""
        pgconn = self.conn.pgconn
        frames: list[memoryview] = []
        deadline = time.monotonic() + timeout
        gather_until: float | None = None  # set when libpq's buffer is first drained with frames in hand
        try:
            while len(frames) < max_frames:
                size, data = pgconn.get_copy_data(1)
                if size > 0:
                    frames.append(data)
                    continue
                if size == -1:
                    raise StreamLost(f"the server ended the replication stream of slot {self.slot}")
                if size == -2:
                    raise StreamLost(f"replication stream of slot {self.slot} failed: "
                                     f"{pgconn.get_error_message().decode(errors='replace')}")
                if frames:
                    # libpq's buffer is drained: take what the socket holds already (a backlog), so a
                    # read is not cut at each refill of the buffer (tens of frames: too few for the
                    # read-at-a-time assembly); but wait for nothing, and under a steady trickle end
                    # the read after GATHER_SECONDS, so the loop still looks at its writes.
                    now = time.monotonic()
                    gather_until = now + GATHER_SECONDS if gather_until is None else gather_until
                    if now > gather_until or not select.select([pgconn.socket], [], [], 0)[0]:
                        break
                    pgconn.consume_input()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._raise_if_stalled()
                    break
                readable, _, _ = select.select([pgconn.socket], [], [], remaining)
                if readable:
                    pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise StreamLost(f"replication connection lost: {exc}") from None
        if frames:  # once per read, not per frame: a read holds up to max_frames
            self.last_heard_at = time.monotonic()
        return frames

    def _raise_if_stalled(self) -> None:
        silent = time.monotonic() - self.last_heard_at
        if self.stall_seconds is not None and silent > self.stall_seconds:
            raise StreamLost(f"the replication stream of slot {self.slot} has been silent for {silent:.1f} s although "
                             f"every status update asks for a reply (bound {self.stall_seconds:g} s = "
                             f"{STALL_INTERVALS} x source.status_interval_seconds): the connection is stalled")

    def status_due(self, interval_seconds: float) -> bool:
        """Whether ``interval_seconds`` have passed since the last status update."""
        return time.monotonic() - self.last_status_at >= interval_seconds

    def send_status(self, flushed_lsn: int, reply_requested: bool = False) -> None:
        """Report ``flushed_lsn`` as written, flushed and applied: the slot may advance to it."""
        now = datetime_to_pg_us(datetime.now(timezone.utc))
        try:
            self.conn.pgconn.put_copy_data(encode_standby_status(max(self.received_lsn, flushed_lsn), flushed_lsn,
                                                                 flushed_lsn, now, reply_requested))
            self.conn.pgconn.flush()
        except psycopg.OperationalError as exc:
            raise StreamLost(f"replication connection lost: {exc}") from None
        self.last_status_at = time.monotonic()
        if self.on_status is not None:
            self.on_status()

    def close(self) -> None:
        self.conn.close()
