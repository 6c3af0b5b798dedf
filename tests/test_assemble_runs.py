"""The read-at-a-time assembly (``Assembler.feed_spans``, ``assemble_runs.plain_run``) against the
message-by-message one (``Assembler.events``): the same events, or the same error, for streams of
every message kind cut into reads anywhere, and for those streams mutated."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_apply.apply.columnar import segment_rows
from cdc_apply.assemble import Assembler
from cdc_apply.changerows.segments import ChangeRowBuilder
from cdc_apply.errors import CdcApplyError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import PgOutputDecoder
from cdc_apply.pgoutput.encode import encode_relation
from cdc_apply.pgoutput.framing import (
    MessageSpans, decode_copy_data, encode_keepalive, encode_xlogdata, split_frames,
)
from cdc_apply.sources.raw import RawMessage
from cdc_apply.spark.rows import segment_batch
from cdc_apply.changerows.run_rows import RunRows
from cdc_apply.transactions import DEFAULT_SPILL_BYTES, RunChanges, SpilledChanges, Transaction

SOURCE = "walsender"


def _relation(oid: int, columns: int = 2) -> bytes:
    return encode_relation(m.Relation(None, oid, "public", f"t{oid}", "d", tuple(
        m.RelationColumn(1 if i == 0 else 0, f"c{i}", 23, -1) for i in range(columns))))


def _tuple(*values: bytes | None) -> bytes:
    parts = [struct.pack("!h", len(values))]
    for value in values:
        parts.append(b"n" if value is None else b"t" + struct.pack("!i", len(value)) + value)
    return b"".join(parts)


def _begin(xid: int, lsn: int = 0x100) -> bytes:
    return b"B" + struct.pack("!qqI", lsn, 700_000, xid)


def _commit(lsn: int, end: int) -> bytes:
    return b"C\x00" + struct.pack("!qqq", lsn, end, 700_001)


def _insert(oid: int, key: int) -> bytes:
    return b"I" + struct.pack("!I", oid) + b"N" + _tuple(str(key).encode(), b"x" * (key % 5))


def _update(oid: int, key: int) -> bytes:
    return b"U" + struct.pack("!I", oid) + b"K" + _tuple(str(key).encode(), None) + b"N" + _tuple(str(key).encode(), b"u")


def _delete(oid: int, key: int) -> bytes:
    return b"D" + struct.pack("!I", oid) + b"K" + _tuple(str(key).encode(), None)


def _stream(data: bytes, xid: int) -> bytes:
    return data[:1] + struct.pack("!I", xid) + data[1:]


def workload(transactions: int = 40) -> list[bytes]:
    """Plain transactions on two tables, with a Relation again, an origin, a truncate, a logical
    message, a streamed transaction with an aborted subtransaction and a prepared one between them."""
    messages = [_relation(16384), _relation(16390, 3)]
    lsn = 0x1000
    for k in range(transactions):
        xid = 1000 + k
        messages.append(_begin(xid, lsn + 90))
        if k == 7:
            messages.append(b"O" + struct.pack("!Q", 0x55) + b"origin_a\x00")
        if k == 11:
            messages.append(_relation(16384, 2))  # the definition again, mid-transaction
        for row in range(k % 6):
            oid = 16384 if row % 2 == 0 else 16390
            messages.append((_insert, _update, _delete)[(k + row) % 3](oid, k * 10 + row))
        if k == 13:
            messages.append(b"T" + struct.pack("!IB", 1, 0) + struct.pack("!I", 16390))
        if k == 17:
            messages.append(b"M\x01" + struct.pack("!Q", lsn) + b"prefix\x00" + struct.pack("!I", 2) + b"hi")
        messages.append(_commit(lsn + 90, lsn + 100))
        lsn += 0x100
        if k == 20:  # a streamed transaction: two blocks, a subtransaction aborted, then committed
            messages += [b"S" + struct.pack("!IB", 77, 1), _stream(_insert(16384, 1), 77), _stream(_insert(16384, 2), 78),
                         b"E", b"A" + struct.pack("!II", 77, 78), b"S" + struct.pack("!IB", 77, 0),
                         _stream(_delete(16384, 1), 77), b"E",
                         b"c" + struct.pack("!IBqqq", 77, 0, lsn + 10, lsn + 20, 700_002)]
            lsn += 0x100
        if k == 25:  # a prepared transaction, then its commit
            messages += [b"b" + struct.pack("!qqqI", lsn + 50, lsn + 60, 700_003, 88) + b"g1\x00",
                         _insert(16390, 5), b"P\x00" + struct.pack("!qqqI", lsn + 50, lsn + 60, 700_003, 88) + b"g1\x00",
                         b"K\x00" + struct.pack("!qqqI", lsn + 70, lsn + 80, 700_004, 88) + b"g1\x00"]
            lsn += 0x100
    return messages


def _spans(messages: list[bytes], first_lsn: int = 0x1000) -> MessageSpans:
    lengths = np.fromiter(map(len, messages), np.int64, len(messages))
    ends = np.cumsum(lengths)
    return MessageSpans(b"".join(messages), ends - lengths, ends, np.arange(len(messages), dtype=np.uint64) * 8 + first_lsn)


def _comparable(event: object) -> object:
    """A transaction whose changes spilled, with its changes read back (a spill file has no equality)."""
    if isinstance(getattr(event, "changes", None), SpilledChanges):
        return ("spilled", replace(event, changes=list(event.changes)))  # type: ignore[type-var, attr-defined]
    return event


def _message_by_message(messages: list[bytes], spill_bytes: int = DEFAULT_SPILL_BYTES) -> list[object]:
    assembler = Assembler(spill_bytes=spill_bytes)
    out: list[object] = []
    try:
        for i, data in enumerate(messages):
            out.extend(map(_comparable, assembler.feed(RawMessage(0x1000 + 8 * i, None, data, SOURCE))))
    except CdcApplyError as exc:
        out.append(("error", type(exc).__name__, str(exc)))
    out.append(("state", assembler.unfinished(), assembler.last_lsn))
    return out


def _read_at_a_time(messages: list[bytes], cuts: list[int], min_run: int = 1,
                    spill_bytes: int = DEFAULT_SPILL_BYTES) -> list[object]:
    assembler = Assembler(min_run_messages=min_run, spill_bytes=spill_bytes)
    spans = _spans(messages)
    out: list[object] = []
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(messages)), len(messages)]
    try:
        for first, stop in zip(bounds, bounds[1:]):
            out.extend(map(_comparable, assembler.feed_spans(MessageSpans(
                spans.data, spans.starts[first:stop], spans.ends[first:stop], spans.lsns[first:stop]), SOURCE)))
    except CdcApplyError as exc:
        out.append(("error", type(exc).__name__, str(exc)))
    out.append(("state", assembler.unfinished(), assembler.last_lsn))
    return out


def test_a_workload_of_every_kind_assembles_the_same_read_at_a_time() -> None:
    messages = workload()
    expected = _message_by_message(messages)
    transactions = [e for e in expected if isinstance(e, m.Message) is False and hasattr(e, "changes")]
    assert len(transactions) == 42 and sum(len(t.changes) for t in transactions) > 90  # type: ignore[attr-defined]
    assert _read_at_a_time(messages, []) == expected
    for size in (1, 2, 3, 7, 50):  # every read boundary, inside transactions too
        assert _read_at_a_time(messages, list(range(0, len(messages), size))) == expected
    for min_run in (3, 10, 10_000):  # short runs message by message, long ones a run at a time
        assert _read_at_a_time(messages, [5, 60], min_run) == expected


def test_a_transaction_past_the_spill_budget_spills_read_at_a_time_too() -> None:
    # 1,300 bytes: a transaction of five changes (five change memories of 256 bytes) goes past it,
    # one of four does not; the others are held whole.
    messages = workload()
    expected = _message_by_message(messages, spill_bytes=1300)
    spilled = [e for e in expected if isinstance(e, tuple) and e[0] == "spilled"]
    assert spilled and len(spilled) < 42
    for cuts in ([], list(range(0, len(messages), 7))):
        assert _read_at_a_time(messages, cuts, spill_bytes=1300) == expected


class _CountingDecoder(PgOutputDecoder):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[int] = []

    def decode(self, data: bytes) -> m.Message:
        self.tags.append(data[0])
        return super().decode(data)


def test_a_plain_run_makes_no_message_object() -> None:
    """Only the Relation message goes through the decoder; the run of plain transactions does not."""
    assembler = Assembler(min_run_messages=1)
    assembler.decoder = decoder = _CountingDecoder()
    messages = [_relation(16384)] + [b for k in range(10) for b in
                                     (_begin(k), _insert(16384, k), _update(16384, k), _commit(0x2000 + k, 0x2001 + k))]
    events = list(assembler.feed_spans(_spans(messages), SOURCE))
    assert decoder.tags == [ord("R")]
    assert [len(t.changes) for t in events] == [2] * 10  # type: ignore[union-attr]
    assert [c.seq for c in events[3].changes] == [0, 1]  # type: ignore[union-attr]


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_streams_give_the_same_events_or_the_same_error(data: st.DataObject) -> None:
    messages = workload(data.draw(st.integers(2, 30)))
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.integers(0, 3))
        at = data.draw(st.integers(0, len(messages) - 1))
        if what == 0 and messages[at]:  # a byte changed
            message = bytearray(messages[at])
            message[data.draw(st.integers(0, len(message) - 1))] = data.draw(st.integers(0, 255))
            messages[at] = bytes(message)
        elif what == 1:  # a message lost
            del messages[at]
        elif what == 2:  # a message sent twice
            messages.insert(at, messages[at])
        elif what == 3:  # a message cut short
            messages[at] = messages[at][:data.draw(st.integers(0, len(messages[at])))]
        if not messages:
            return
    cuts = data.draw(st.lists(st.integers(0, len(messages)), max_size=6))
    assert _read_at_a_time(messages, cuts) == _message_by_message(messages)


def test_split_frames_gives_what_decode_copy_data_gives() -> None:
    frames = [encode_xlogdata(0x10 + i, 0x99, 5, b"B" * i) for i in range(4)]
    frames.insert(2, encode_keepalive(0x500, 6, True))
    frames.append(encode_xlogdata(2 ** 64 - 1, 1, 1, b"big"))
    received = split_frames([memoryview(frame) for frame in frames])
    decoded = [decode_copy_data(frame) for frame in frames]
    xlog = [d for d in decoded if hasattr(d, "payload")]
    assert [received.messages.message(i) for i in range(len(received.messages))] == [d.payload for d in xlog]  # type: ignore[union-attr]
    assert received.messages.lsns.tolist() == [d.start_lsn for d in xlog]  # type: ignore[union-attr]
    assert (received.wal_end, received.keepalive_end, received.reply_requested) == (2 ** 64 - 1, 0x500, True)


@pytest.mark.parametrize("frame", [b"", b"w" + b"\x00" * 10, b"k" + b"\x00" * 20, b"x123"])
def test_split_frames_raises_the_frames_own_error(frame: bytes) -> None:
    with pytest.raises(CdcApplyError) as expected:
        decode_copy_data(frame)
    with pytest.raises(CdcApplyError) as got:
        split_frames([encode_keepalive(1, 2, False), frame])
    assert str(got.value) == str(expected.value)


def _with_text_columns(messages: list[bytes]) -> list[bytes]:
    """The workload with two columns a table, the key and a text, so that its rows convert."""
    out = []
    for data in messages:
        if data[:1] == b"R":
            relation = PgOutputDecoder().decode(data)
            assert isinstance(relation, m.Relation)
            data = encode_relation(replace(relation, columns=tuple(
                column if i == 0 else replace(column, type_oid=25) for i, column in enumerate(relation.columns[:2]))))
        out.append(data)
    return out


def _change_rows(batch: list[Transaction]) -> list[object]:
    """Everything the change rows of a batch give: per segment its changes, Arrow rows, Python rows,
    the columnar collapse's input and the change log's record batch."""
    rows: list[object] = []
    for segment in ChangeRowBuilder().build(batch):
        rows += [segment.qualified_name, list(segment.changes), segment.transactions, segment.to_arrow(),
                 segment.rows, segment_rows(segment), segment_batch(segment)]
    return rows


@pytest.mark.parametrize("cut_every", [0, 7, 50])
def test_change_rows_of_a_run_s_columns_are_the_change_rows_of_its_changes(cut_every: int) -> None:
    """The change rows (``ChangeRowBuilder``) of transactions read a run at a time, whose changes stay
    columns over the read (``RunChanges``, then ``RunRows``), are those of the same transactions
    assembled message by message: in one batch, and in a batch per read; a streamed transaction,
    a truncate and short runs mixed in."""
    messages = _with_text_columns(workload())
    assembler = Assembler()
    by_message = list(assembler.transactions(RawMessage(0x1000 + 8 * i, None, data, SOURCE)
                                             for i, data in enumerate(messages)))
    spans = _spans(messages)
    bounds = [0, *range(cut_every, len(messages), cut_every or len(messages)), len(messages)] if cut_every \
        else [0, len(messages)]
    assembler = Assembler(min_run_messages=1)
    reads = [[e for e in assembler.feed_spans(MessageSpans(spans.data, spans.starts[first:stop], spans.ends[first:stop],
                                                           spans.lsns[first:stop]), SOURCE)
              if isinstance(e, Transaction)] for first, stop in zip(bounds, bounds[1:])]
    by_run = [t for read in reads for t in read]
    assert by_run == by_message
    assert any(isinstance(t.changes, RunChanges) for t in by_run)
    assert any(isinstance(t.changes, list) for t in by_run)
    segments = ChangeRowBuilder().build(by_run)
    assert any(isinstance(s.changes, RunRows) for s in segments)
    assert _change_rows(by_run) == _change_rows(by_message)
    read_batches = [[by_message[i] for i in range(sum(map(len, reads[:k])), sum(map(len, reads[:k + 1])))]
                    for k in range(len(reads))]
    for read, same in zip(reads, read_batches, strict=True):
        assert _change_rows(read) == _change_rows(same)
