"""Builders of hand-made pgoutput captures for the hostile-input tests (protocol 1 layouts)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

OID = 16384
Column = tuple[int, str, int, int]  # flags, name, type OID, typmod


def relation(columns: Sequence[Column], *, oid: int = OID, namespace: str = "public", name: str = "t",
             identity: bytes = b"d") -> bytes:
    return (b"R" + struct.pack("!I", oid) + namespace.encode() + b"\0" + name.encode() + b"\0" + identity
            + struct.pack("!h", len(columns))
            + b"".join(struct.pack("!B", f) + n.encode() + b"\0" + struct.pack("!Ii", t, m) for f, n, t, m in columns))


def text_value(value: bytes | None) -> bytes:
    return b"n" if value is None else b"t" + struct.pack("!i", len(value)) + value


def binary_value(value: bytes) -> bytes:
    return b"b" + struct.pack("!i", len(value)) + value


def tuple_data(values: Sequence[bytes]) -> bytes:
    """``values``: each already encoded by ``text_value`` or ``binary_value``."""
    return struct.pack("!h", len(values)) + b"".join(values)


def insert(values: Sequence[bytes | None], *, oid: int = OID) -> bytes:
    return b"I" + struct.pack("!I", oid) + b"N" + tuple_data([text_value(v) for v in values])


def begin(xid: int = 700, final_lsn: int = 0x1000) -> bytes:
    return b"B" + struct.pack("!QqI", final_lsn, 1000, xid)


def commit(lsn: int = 0x1000) -> bytes:
    return b"C\x00" + struct.pack("!QQq", lsn, lsn + 8, 1000)


def write_capture(path: Path, messages: Sequence[bytes], *, xid: int = 700, lsns: Sequence[int] | None = None) -> Path:
    lsns = lsns or [0x100 + i for i in range(len(messages))]
    with open(path, "w") as handle:
        for lsn, data in zip(lsns, messages, strict=True):
            handle.write(json.dumps({"lsn": f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}", "xid": xid, "data": data.hex()})
                         + "\n")
    return path


def one_insert(path: Path, columns: Sequence[Column], values: Sequence[bytes | None], **relation_args: object) -> Path:
    """A capture of one transaction inserting one row."""
    return write_capture(path, [begin(), relation(columns, **relation_args), insert(values), commit()])  # type: ignore[arg-type]
