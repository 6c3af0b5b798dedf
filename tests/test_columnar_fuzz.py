"""The column-at-a-time change-row builder against the change-by-change one, on mutated messages.

Whatever bytes arrive, both paths agree: the same rows, or both a clean CdcApplyError. The
columnar parse must never read a malformed tuple as data.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_apply.assemble import Assembler
from cdc_apply.changerows.segments import change_rows
from cdc_apply.errors import CdcApplyError
from cdc_apply.sources.raw import RawMessage
from tests.rows_compare import normalised

OID = 16384
# id int4 (key), note text, amount numeric(12,2), at timestamptz, score float8
COLUMNS = [(1, "id", 23, -1), (0, "note", 25, -1), (0, "amount", 1700, (12 << 16 | 2) + 4),
           (0, "at", 1184, -1), (0, "score", 701, -1)]
RELATION = (b"R" + struct.pack("!I", OID) + b"public\x00t\x00d" + struct.pack("!h", len(COLUMNS))
            + b"".join(struct.pack("!B", f) + n.encode() + b"\x00" + struct.pack("!Ii", t, mod) for f, n, t, mod in COLUMNS))
BEGIN = b"B" + struct.pack("!QqI", 0x100, 1000, 700)
COMMIT = b"C\x00" + struct.pack("!QQq", 0x100, 0x108, 1000)


def _text(value: bytes | None) -> bytes:
    return b"n" if value is None else b"t" + struct.pack("!i", len(value)) + value


def _binary(value: bytes | None) -> bytes:
    return b"n" if value is None else b"b" + struct.pack("!i", len(value)) + value


def _tuple(parts: list[bytes]) -> bytes:
    return struct.pack("!h", len(parts)) + b"".join(parts)


TEXT_ROW = _tuple([_text(b"7"), _text("héllo".encode()), _text(b"-12.34"), _text(b"2024-02-29 12:34:56.789+02"),
                   _text(b"NaN")])
BINARY_ROW = _tuple([_binary(struct.pack("!i", 7)), _binary(b"note"),
                     _binary(struct.pack("!hhHH", 2, 0, 0x4000, 2) + struct.pack("!HH", 12, 3400)),
                     _binary(struct.pack("!q", 1000)), _binary(struct.pack("!d", -0.0))])
TOASTED_ROW = _tuple([_text(b"8"), b"u", _text(b"0.01"), b"n", _text(b"-Infinity")])
KEY_ONLY = _tuple([_text(b"7"), b"n", b"n", b"n", b"n"])
SEEDS = [
    b"I" + struct.pack("!I", OID) + b"N" + TEXT_ROW,
    b"I" + struct.pack("!I", OID) + b"N" + BINARY_ROW,
    b"U" + struct.pack("!I", OID) + b"N" + TOASTED_ROW,
    b"U" + struct.pack("!I", OID) + b"K" + KEY_ONLY + b"N" + TEXT_ROW,
    b"U" + struct.pack("!I", OID) + b"O" + BINARY_ROW + b"N" + TEXT_ROW,
    b"D" + struct.pack("!I", OID) + b"K" + KEY_ONLY,
    b"D" + struct.pack("!I", OID) + b"O" + TEXT_ROW,
    b"T" + struct.pack("!iBI", 1, 1, OID),
]


def _outcome(messages: list[bytes], columnar: bool) -> object:
    raws = [RawMessage(0x100 + i, None, data, f"fuzz:{i}") for i, data in enumerate([RELATION, BEGIN, *messages, COMMIT])]
    try:
        segments = change_rows(Assembler().transactions(raws))
        return ("rows", [normalised(s.rows if columnar else s.scalar_rows()) for s in segments])
    except CdcApplyError as exc:
        assert str(exc)
        return ("error",)


def _mutate(seed: bytes, data: st.DataObject) -> bytes:
    mutated = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 3))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        choice = data.draw(st.integers(0, 2))
        if choice == 0:
            mutated[position] = data.draw(st.integers(0, 255))
        elif choice == 1:
            del mutated[position]
        else:
            mutated.insert(position, data.draw(st.integers(0, 255)))
    return bytes(mutated)


def test_seeds_give_the_same_rows_both_ways() -> None:
    outcome = _outcome(SEEDS, columnar=True)
    assert outcome[0] == "rows" and outcome == _outcome(SEEDS, columnar=False)
    rows = outcome[1][0]  # type: ignore[index]
    assert [r["op"] for r in rows] == list("IIUUUDDT") and rows[-1]["truncate_options"] == 1
    assert rows[2]["unchanged"] == ["note"] and rows[3]["key"] == {"id": 7}
    assert rows[4]["old"]["amount"] == rows[1]["new"]["amount"] and str(rows[1]["new"]["amount"]) == "-12.34"


def test_a_segment_of_truncates_only() -> None:
    outcome = _outcome([SEEDS[-1], SEEDS[-1]], columnar=True)
    assert outcome == _outcome([SEEDS[-1], SEEDS[-1]], columnar=False)
    assert [r["op"] for r in outcome[1][0]] == ["T", "T"]  # type: ignore[index]


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(SEEDS), min_size=1, max_size=4), st.data())
def test_mutated_row_messages_agree_or_both_fail(batch: list[bytes], data: st.DataObject) -> None:
    victim = data.draw(st.integers(0, len(batch) - 1))
    batch = [*batch[:victim], _mutate(batch[victim], data), *batch[victim + 1:]]
    assert _outcome(batch, columnar=True) == _outcome(batch, columnar=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("tbnu"), st.binary(max_size=40), st.integers(0, 6)), max_size=30),
       st.sampled_from([1, 3, 16, 64, 1 << 20]), st.booleans())
def test_gathering_values_gives_every_value_whole(values, chunk_bytes, in_order) -> None:  # type: ignore[no-untyped-def]
    """Spans in buffer order, with gaps between them (a row image's values between their headers), are
    taken in place (one copy per value); spans out of order are gathered byte-wise, at most
    GATHER_CHUNK_BYTES of values per step (it bounds the memory of a huge batch). Either way values
    longer than a chunk, chunk edges inside a value, empty values, nulls and unchanged TOAST come out
    exactly as sent."""
    import numpy as np

    from cdc_apply.pgoutput import tuple_columns
    from cdc_apply.pgoutput import messages as m

    buf = np.frombuffer(b"#" + b"".join(b"-" * gap + data for _, data, gap in values), np.uint8)
    starts = np.cumsum([1] + [gap + len(data) for _, data, gap in values])[:-1] + [gap for _, _, gap in values]
    order = slice(None) if in_order else slice(None, None, -1)
    values, starts = values[order], starts[order]
    kinds = np.array([ord(kind) for kind, _, _ in values], np.uint8)
    lengths = np.array([len(data) for _, data, _ in values], np.int64)
    saved = tuple_columns.GATHER_CHUNK_BYTES
    tuple_columns.GATHER_CHUNK_BYTES = chunk_bytes
    try:
        gathered = tuple_columns.gather_values(buf, kinds, np.asarray(starts, np.int64), lengths).to_pylist()
    finally:
        tuple_columns.GATHER_CHUNK_BYTES = saved
    assert gathered == [data if kind in (chr(m.KIND_TEXT), chr(m.KIND_BINARY)) else None for kind, data, _ in values]
