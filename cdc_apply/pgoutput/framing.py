"""Replication framing inside CopyData: XLogData 'w' and keepalive 'k' in, standby status 'r' out."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cdc_apply.bigendian import uint64_at
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


@dataclass(slots=True)
class MessageSpans:
    """Messages received together, as spans over one buffer: no object per message. Message ``i``
    is ``data[starts[i]:ends[i]]``, at WAL position ``lsns[i]`` (starts and ends int64, LSNs uint64)."""

    data: bytes
    starts: np.ndarray
    ends: np.ndarray
    lsns: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def message(self, i: int) -> bytes:
        return self.data[self.starts[i]:self.ends[i]]


@dataclass(slots=True)
class ReceivedFrames:
    """One read's CopyData frames: the XLogData messages as spans over the joined frames, and what
    the keepalives among them said."""

    messages: MessageSpans
    wal_end: int  # the highest position seen: an XLogData's start or a keepalive's WAL end (0: none)
    keepalive_end: int | None  # the last keepalive's WAL end
    reply_requested: bool  # a keepalive asked for a reply


def split_frames(frames: Sequence[bytes | memoryview]) -> ReceivedFrames:
    """The frames of one read, joined once and split by numpy (``decode_copy_data`` frame by frame
    gives the same, one object per frame). A frame that is not well formed raises the error
    ``decode_copy_data`` gives it."""
    count = len(frames)
    lengths = np.fromiter(map(len, frames), np.int64, count)
    starts = np.zeros(count, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    data = b"".join(frames)
    buf = np.frombuffer(data, np.uint8)
    kinds = buf[np.minimum(starts, max(len(buf) - 1, 0))] if len(buf) else np.zeros(count, np.uint8)
    xlog = (kinds == _W) & (lengths >= _XLOG_HEADER.size)
    keepalive = (kinds == _K) & (lengths == _KEEPALIVE.size)
    if not (xlog | keepalive).all():
        decode_copy_data(frames[int(np.argmin(xlog | keepalive))])  # raises the frame's error
    positions = uint64_at(buf, starts + 1)  # XLogData's start LSN, a keepalive's WAL end
    xlog_starts = starts[xlog]
    messages = MessageSpans(data, xlog_starts + _XLOG_HEADER.size, xlog_starts + lengths[xlog], positions[xlog])
    keepalive_ends = positions[keepalive]
    return ReceivedFrames(messages, int(positions.max()) if count else 0,
                          int(keepalive_ends[-1]) if len(keepalive_ends) else None,
                          bool(buf[starts[keepalive] + _KEEPALIVE.size - 1].any()) if len(keepalive_ends) else False)


def encode_standby_status(written: int, flushed: int, applied: int, client_time: int,
                          reply_requested: bool = False) -> bytes:
    """Standby status update. LSNs as ints; client_time in microseconds since the PostgreSQL epoch."""
    return _STATUS_UPDATE.pack(b"r", written, flushed, applied, client_time, int(reply_requested))


def encode_keepalive(wal_end: int, send_time: int, reply_requested: bool) -> bytes:
    """The server side of a keepalive, for tests and replay tools."""
    return _KEEPALIVE.pack(b"k", wal_end, send_time, int(reply_requested))


def encode_xlogdata(start_lsn: int, wal_end: int, send_time: int, payload: bytes) -> bytes:
    return _XLOG_HEADER.pack(b"w", start_lsn, wal_end, send_time) + payload
