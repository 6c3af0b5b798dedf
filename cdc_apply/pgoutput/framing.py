"""Replication framing inside CopyData: XLogData 'w' and keepalive 'k' in, standby status 'r' out."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cdc_apply.errors import DecodeError

_XLOG_HEADER = struct.Struct("!cQQq")  # 'w', start LSN, server WAL end, send time
_KEEPALIVE = struct.Struct("!cQqB")  # 'k', server WAL end, send time, reply requested
_STATUS_UPDATE = struct.Struct("!cQQQqB")  # 'r', written, flushed, applied, client time, reply now
_W, _K = ord("w"), ord("k")


# Not frozen: a frozen dataclass's __init__ costs about 3x, and one XLogData is made per message received.
@dataclass(slots=True)
class XLogData:
    start_lsn: int
    wal_end: int
    send_time: int
    payload: bytes


@dataclass(slots=True)
class Keepalive:
    wal_end: int
    send_time: int
    reply_requested: bool


def decode_copy_data(frame: bytes | memoryview) -> XLogData | Keepalive:
    """One CopyData frame; ``frame`` may be the connection's buffer itself: the payload is copied
    out of it once."""
    if not frame:
        raise DecodeError("empty CopyData frame", offset=0)
    kind = frame[0]
    if kind == _W:
        if len(frame) < _XLOG_HEADER.size:
            raise DecodeError(f"truncated XLogData header: {len(frame)} of {_XLOG_HEADER.size} bytes",
                              tag="w", offset=len(frame))
        _, start, end, sent = _XLOG_HEADER.unpack_from(frame)
        return XLogData(start, end, sent, bytes(frame[_XLOG_HEADER.size:]))
    if kind == _K:
        if len(frame) != _KEEPALIVE.size:
            raise DecodeError(f"keepalive is {len(frame)} bytes, expected {_KEEPALIVE.size}",
                              tag="k", offset=min(len(frame), _KEEPALIVE.size))
        _, end, sent, reply = _KEEPALIVE.unpack(frame)
        return Keepalive(end, sent, bool(reply))
    raise DecodeError(f"unknown replication frame type {kind:#04x}", tag=chr(kind), offset=0)


def encode_standby_status(written: int, flushed: int, applied: int, client_time: int,
                          reply_requested: bool = False) -> bytes:
    """Standby status update. LSNs as ints; client_time in microseconds since the PostgreSQL epoch."""
    return _STATUS_UPDATE.pack(b"r", written, flushed, applied, client_time, int(reply_requested))


def encode_keepalive(wal_end: int, send_time: int, reply_requested: bool) -> bytes:
    """The server side of a keepalive, for tests and replay tools."""
    return _KEEPALIVE.pack(b"k", wal_end, send_time, int(reply_requested))


def encode_xlogdata(start_lsn: int, wal_end: int, send_time: int, payload: bytes) -> bytes:
    return _XLOG_HEADER.pack(b"w", start_lsn, wal_end, send_time) + payload
