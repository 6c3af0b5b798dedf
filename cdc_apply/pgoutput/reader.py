"""A cursor over one message's bytes. Every read is length-guarded and fails with the byte offset."""

from __future__ import annotations

import struct

from cdc_apply.errors import DecodeError

_INT16 = struct.Struct("!h")
_INT32 = struct.Struct("!i")
_UINT32 = struct.Struct("!I")
_INT64 = struct.Struct("!q")
MAX_LSN = 2**63 - 1
_UINT64 = struct.Struct("!Q")


class Reader:
    __slots__ = ("data", "pos", "end", "tag")

    def __init__(self, data: bytes, pos: int = 0, tag: str | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data)
        self.tag = tag

    def fail(self, reason: str, offset: int | None = None) -> DecodeError:
        return DecodeError(reason, tag=self.tag, offset=self.pos if offset is None else offset)

    def need(self, size: int, what: str) -> None:
        if self.pos + size > self.end:
            raise self.fail(f"truncated: {what} needs {size} bytes, {self.end - self.pos} left")

    def byte(self, what: str) -> int:
        self.need(1, what)
        value = self.data[self.pos]
        self.pos += 1
        return value

    def char(self, what: str) -> str:
        return chr(self.byte(what))

    def int16(self, what: str) -> int:
        self.need(2, what)
        (value,) = _INT16.unpack_from(self.data, self.pos)
        self.pos += 2
        return value

    def int32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _INT32.unpack_from(self.data, self.pos)
        self.pos += 4
        return value

    def uint32(self, what: str) -> int:
        """OIDs and xids are unsigned 32-bit on the wire."""
        self.need(4, what)
        (value,) = _UINT32.unpack_from(self.data, self.pos)
        self.pos += 4
        return value

    def int64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _INT64.unpack_from(self.data, self.pos)
        self.pos += 8
        return value

    def uint64(self, what: str) -> int:
        """LSNs are unsigned 64-bit on the wire, but no WAL position reaches 2^63, and Delta's
        transaction versions (which hold commit LSNs) are signed: refuse one past it."""
        self.need(8, what)
        (value,) = _UINT64.unpack_from(self.data, self.pos)
        if value > MAX_LSN:
            raise self.fail(f"{what} {value:#x} is past any WAL position (2^63 - 1)")
        self.pos += 8
        return value

    def cstring(self, what: str) -> str:
        stop = self.data.find(b"\x00", self.pos)
        if stop < 0:
            raise self.fail(f"truncated: {what} has no terminating NUL")
        raw = self.data[self.pos:stop]
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8: {exc.reason}", self.pos + exc.start) from None
        self.pos = stop + 1
        return value

    def take(self, size: int, what: str) -> bytes:
        if size < 0:
            raise self.fail(f"{what} has negative length {size}")
        self.need(size, what)
        value = self.data[self.pos:self.pos + size]
        self.pos += size
        return value

    def expect_end(self) -> None:
        if self.pos != self.end:
            raise self.fail(f"{self.end - self.pos} unexpected trailing bytes")
