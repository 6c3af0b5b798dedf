"""Bytes of one pgoutput message -> one typed message.

The decoder holds exactly one piece of state: whether it is inside a Stream Start..Stream Stop
block, because only there do DML, Relation, Type and Message messages carry a leading xid
(protocol 2+). Everything else needed to decode is in the message itself; protocol 4's
Stream Abort extra fields are recognised by the message length, so no manifest is needed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from cdc_apply.errors import DecodeError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.reader import Reader

_TUPLE_HEADER = struct.Struct("!h")
_VALUE_LENGTH = struct.Struct("!i")
_NO_DATA_KINDS = (m.KIND_NULL, m.KIND_UNCHANGED_TOAST)
_DATA_KINDS = (m.KIND_TEXT, m.KIND_BINARY)

MAX_COLUMNS = 1600  # PostgreSQL's MaxHeapAttributeNumber: no table has more

# The Insert/Update/Delete layout, defined once for the scalar decoder here, the assembler's
# header fast path and the column-at-a-time parse: tag Byte1, [xid Int32 inside a stream block],
# relation OID Int32, a tuple marker Byte1 and TupleData; an Update whose first marker is K or O
# has a second marker N and the new TupleData.
ROW_MARKERS = {ord("I"): "N", ord("U"): "KON", ord("D"): "KO"}  # tag -> the first markers allowed
STREAM_XID_SIZE = 4


def row_marker_offset(in_stream: bool) -> int:
    """Where an Insert/Update/Delete's first tuple marker is: after the tag, [xid,] relation OID."""
    return 1 + (STREAM_XID_SIZE if in_stream else 0) + 4


def relation_oid_offset(in_stream: bool) -> int:
    return row_marker_offset(in_stream) - 4


def outside_stream_block(data: bytes, in_stream: bool) -> bytes:
    """A DML/Relation/Type/Message message as it reads outside a stream block: without the xid."""
    return data[:1] + data[1 + STREAM_XID_SIZE:] if in_stream else data
STREAM_ABORT_V2_LENGTH = 1 + 4 + 4
STREAM_ABORT_V4_LENGTH = STREAM_ABORT_V2_LENGTH + 8 + 8


def read_tuple(r: Reader) -> m.TupleData:
    """TupleData: Int16 column count, then per column a kind byte and, for t/b, Int32 length + bytes."""
    r.need(2, "TupleData column count")
    data = r.data
    (count,) = _TUPLE_HEADER.unpack_from(data, r.pos)
    if count < 0:
        raise r.fail(f"TupleData column count is negative ({count})")
    pos = r.pos + 2
    end = r.end
    kinds = bytearray(count)
    values: list[bytes | None] = [None] * count
    for i in range(count):
        if pos >= end:
            r.pos = pos
            raise r.fail(f"truncated: TupleData column {i} of {count} has no kind byte")
        kind = data[pos]
        kinds[i] = kind
        pos += 1
        if kind in _DATA_KINDS:
            if pos + 4 > end:
                r.pos = pos
                raise r.fail(f"truncated: TupleData column {i} length")
            (length,) = _VALUE_LENGTH.unpack_from(data, pos)
            pos += 4
            if length < 0:
                r.pos = pos - 4
                raise r.fail(f"TupleData column {i} has negative length {length}")
            if pos + length > end:
                r.pos = pos - 4
                raise r.fail(f"truncated: TupleData column {i} length {length} exceeds the {end - pos} bytes left")
            values[i] = data[pos:pos + length]
            pos += length
        elif kind not in _NO_DATA_KINDS:
            r.pos = pos - 1
            raise r.fail(f"TupleData column {i} has unknown kind {kind:#04x}")
    r.pos = pos
    return m.TupleData(bytes(kinds), tuple(values))


def _old_image_marker(r: Reader, allowed: str, what: str) -> str:
    marker = r.char(what)
    if marker not in allowed:
        raise r.fail(f"{what} is {marker!r}, expected one of {', '.join(allowed)}", r.pos - 1)
    return marker


def _begin(r: Reader, xid: int | None) -> m.Begin:
    return m.Begin(r.uint64("final LSN"), r.int64("commit timestamp"), r.uint32("xid"))


def _commit(r: Reader, xid: int | None) -> m.Commit:
    return m.Commit(r.byte("flags"), r.uint64("commit LSN"), r.uint64("end LSN"), r.int64("commit timestamp"))


def _origin(r: Reader, xid: int | None) -> m.Origin:
    return m.Origin(r.uint64("origin commit LSN"), r.cstring("origin name"))


def _logical_message(r: Reader, xid: int | None) -> m.LogicalMessage:
    flags = r.byte("flags")
    if flags not in (0, 1):
        raise r.fail(f"flags is {flags}, expected 0 or 1", r.pos - 1)
    lsn = r.uint64("message LSN")
    prefix = r.cstring("prefix")
    content = r.take(r.int32("content length"), "content")
    return m.LogicalMessage(xid, bool(flags), lsn, prefix, content)


def _relation(r: Reader, xid: int | None) -> m.Relation:
    oid = r.uint32("relation OID")
    namespace = r.cstring("namespace")
    name = r.cstring("relation name")
    identity = r.char("replica identity")
    if identity not in m.REPLICA_IDENTITY_NAMES:
        raise r.fail(f"replica identity is {identity!r}, expected d, n, f or i", r.pos - 1)
    count = r.int16("column count")
    if not 0 <= count <= MAX_COLUMNS:
        raise r.fail(f"column count {count} is outside 0..{MAX_COLUMNS}", r.pos - 2)
    columns = []
    names: set[str] = set()
    for _ in range(count):
        start = r.pos
        column = m.RelationColumn(r.byte("column flags"), r.cstring("column name"), r.uint32("column type OID"),
                                  r.int32("column type modifier"))
        if column.name in names:
            raise r.fail(f"column name {column.name[:64]!r} appears twice", start)
        names.add(column.name)
        columns.append(column)
    return m.Relation(xid, oid, namespace, name, identity, tuple(columns))


def _type(r: Reader, xid: int | None) -> m.Type:
    return m.Type(xid, r.uint32("type OID"), r.cstring("namespace"), r.cstring("type name"))


def _insert(r: Reader, xid: int | None) -> m.Insert:
    oid = r.uint32("relation OID")
    _old_image_marker(r, ROW_MARKERS[ord("I")], "new tuple marker")
    return m.Insert(xid, oid, read_tuple(r))


def _update(r: Reader, xid: int | None) -> m.Update:
    oid = r.uint32("relation OID")
    marker = _old_image_marker(r, ROW_MARKERS[ord("U")], "tuple marker")
    old = None
    old_kind = None
    if marker != "N":
        old_kind = marker
        old = read_tuple(r)
        _old_image_marker(r, "N", "new tuple marker")
    return m.Update(xid, oid, old_kind, old, read_tuple(r))


def _delete(r: Reader, xid: int | None) -> m.Delete:
    oid = r.uint32("relation OID")
    marker = _old_image_marker(r, ROW_MARKERS[ord("D")], "old tuple marker")
    return m.Delete(xid, oid, marker, read_tuple(r))


def _truncate(r: Reader, xid: int | None) -> m.Truncate:
    count = r.int32("relation count")
    if count < 0:
        raise r.fail(f"relation count is negative ({count})", r.pos - 4)
    options = r.byte("option bits")
    if options & ~(m.TRUNCATE_CASCADE | m.TRUNCATE_RESTART_IDENTITY):
        raise r.fail(f"option bits {options:#04x} hold bits other than CASCADE (1) and RESTART IDENTITY (2)",
                     r.pos - 1)
    r.need(4 * count, f"{count} relation OIDs")
    return m.Truncate(xid, options, tuple(r.uint32("relation OID") for _ in range(count)))


def _stream_start(r: Reader, xid: int | None) -> m.StreamStart:
    stream_xid = r.uint32("xid")
    first = r.byte("first segment flag")
    if first not in (0, 1):
        raise r.fail(f"first segment flag is {first}, expected 0 or 1", r.pos - 1)
    return m.StreamStart(stream_xid, bool(first))


def _stream_stop(r: Reader, xid: int | None) -> m.StreamStop:
    return m.StreamStop()


def _stream_commit(r: Reader, xid: int | None) -> m.StreamCommit:
    return m.StreamCommit(r.uint32("xid"), r.byte("flags"), r.uint64("commit LSN"), r.uint64("end LSN"),
                          r.int64("commit timestamp"))


def _stream_abort(r: Reader, xid: int | None) -> m.StreamAbort:
    if r.end not in (STREAM_ABORT_V2_LENGTH, STREAM_ABORT_V4_LENGTH):
        raise r.fail(f"Stream Abort is {r.end} bytes long, expected {STREAM_ABORT_V2_LENGTH} "
                     f"(protocol 2-3) or {STREAM_ABORT_V4_LENGTH} (protocol 4)")
    top_xid, subxid = r.uint32("xid"), r.uint32("subtransaction xid")
    if r.end == STREAM_ABORT_V2_LENGTH:
        return m.StreamAbort(top_xid, subxid)
    return m.StreamAbort(top_xid, subxid, r.uint64("abort LSN"), r.int64("abort timestamp"))


def _begin_prepare(r: Reader, xid: int | None) -> m.BeginPrepare:
    return m.BeginPrepare(r.uint64("prepare LSN"), r.uint64("end LSN"), r.int64("prepare timestamp"),
                          r.uint32("xid"), r.cstring("GID"))


def _prepare_like(cls: type[m.Prepare] | type[m.StreamPrepare] | type[m.CommitPrepared]) -> Callable[..., m.Message]:
    """Prepare, Stream Prepare and Commit Prepared share one layout: flags, 2 LSNs, timestamp, xid, GID."""

    def parse(r: Reader, xid: int | None) -> m.Message:
        return cls(r.byte("flags"), r.uint64("first LSN"), r.uint64("end LSN"), r.int64("timestamp"),
                   r.uint32("xid"), r.cstring("GID"))

    return parse


def _rollback_prepared(r: Reader, xid: int | None) -> m.RollbackPrepared:
    return m.RollbackPrepared(r.byte("flags"), r.uint64("prepare end LSN"), r.uint64("rollback end LSN"),
                              r.int64("prepare timestamp"), r.int64("rollback timestamp"), r.uint32("xid"),
                              r.cstring("GID"))


Parser = Callable[[Reader, "int | None"], m.Message]

# tag byte -> (parser, carries a leading xid inside a streamed block)
PARSERS: dict[int, tuple[Parser, bool]] = {
    ord("B"): (_begin, False),
    ord("C"): (_commit, False),
    ord("O"): (_origin, False),
    ord("M"): (_logical_message, True),
    ord("R"): (_relation, True),
    ord("Y"): (_type, True),
    ord("I"): (_insert, True),
    ord("U"): (_update, True),
    ord("D"): (_delete, True),
    ord("T"): (_truncate, True),
    ord("S"): (_stream_start, False),
    ord("E"): (_stream_stop, False),
    ord("c"): (_stream_commit, False),
    ord("A"): (_stream_abort, False),
    ord("b"): (_begin_prepare, False),
    ord("P"): (_prepare_like(m.Prepare), False),
    ord("p"): (_prepare_like(m.StreamPrepare), False),
    ord("K"): (_prepare_like(m.CommitPrepared), False),
    ord("r"): (_rollback_prepared, False),
}


# Begin and Commit come with every transaction and have a fixed length: one unpack each. The LSNs
# are read signed, so one past 2^63 - 1 reads negative and goes to the field-by-field path, whose
# error names it (as does any other length).
_BEGIN = struct.Struct("!qqI")  # final LSN, commit timestamp, xid
_COMMIT = struct.Struct("!Bqqq")  # flags, commit LSN, end LSN, commit timestamp
_B, _C = ord("B"), ord("C")


def _fixed_length(data: bytes) -> m.Message | None:
    tag = data[0]
    if tag == _B and len(data) == 1 + _BEGIN.size:
        final_lsn, commit_ts, xid = _BEGIN.unpack_from(data, 1)
        if final_lsn >= 0:
            return m.Begin(final_lsn, commit_ts, xid)
    elif tag == _C and len(data) == 1 + _COMMIT.size:
        flags, commit_lsn, end_lsn, commit_ts = _COMMIT.unpack_from(data, 1)
        if commit_lsn >= 0 and end_lsn >= 0:
            return m.Commit(flags, commit_lsn, end_lsn, commit_ts)
    return None


class PgOutputDecoder:
    """Decodes a sequence of pgoutput messages in stream order.

    ``in_stream`` may be given when a batch starts inside a Stream Start..Stop block.
    """

    __slots__ = ("in_stream",)

    def __init__(self, in_stream: bool = False) -> None:
        self.in_stream = in_stream

    def decode(self, data: bytes) -> m.Message:
        if not data:
            raise DecodeError("empty message", offset=0)
        if (fixed := _fixed_length(data)) is not None:
            return fixed
        entry = PARSERS.get(data[0])
        tag = chr(data[0])
        if entry is None:
            raise DecodeError(f"unknown message type byte {data[0]:#04x}", tag=tag, offset=0)
        parse, has_stream_xid = entry
        r = Reader(data, 1, tag)
        xid = r.uint32("streamed transaction xid") if has_stream_xid and self.in_stream else None
        message = parse(r, xid)
        r.expect_end()
        if tag == "S":
            if self.in_stream:
                raise DecodeError("Stream Start inside an open stream block", tag=tag, offset=0)
            self.in_stream = True
        elif tag == "E":
            if not self.in_stream:
                raise DecodeError("Stream Stop outside a stream block", tag=tag, offset=0)
            self.in_stream = False
        return message


def decode_message(data: bytes, in_stream: bool = False) -> m.Message:
    """Decode one message without stream state (convenience for tests and tools)."""
    return PgOutputDecoder(in_stream).decode(data)
