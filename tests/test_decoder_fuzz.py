"""Random and mutated messages: a clean DecodeError or a correct decode, never a crash or a hang."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_apply.errors import DecodeError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import PARSERS, PgOutputDecoder, decode_message

INSERT = (b"I" + struct.pack("!I", 16384) + b"N" + struct.pack("!h", 3)
          + b"t" + struct.pack("!i", 2) + b"42" + b"n" + b"u")
UPDATE_K = (b"U" + struct.pack("!I", 16384) + b"K" + struct.pack("!h", 1) + b"t" + struct.pack("!i", 1) + b"7"
            + b"N" + struct.pack("!h", 1) + b"b" + struct.pack("!i", 4) + struct.pack("!i", 8))
RELATION = (b"R" + struct.pack("!I", 16384) + b"public\x00t\x00d" + struct.pack("!h", 1)
            + b"\x01id\x00" + struct.pack("!Ii", 23, -1))
COMMIT_PREPARED = b"K\x00" + struct.pack("!QQqI", 0x10, 0x20, 5, 700) + b"gid-1\x00"
SEEDS = [INSERT, UPDATE_K, RELATION, COMMIT_PREPARED, b"S" + struct.pack("!IB", 9, 1), b"E",
         b"A" + struct.pack("!II", 9, 10), b"A" + struct.pack("!IIQq", 9, 9, 0x30, 1)]


def _decode_or_error(data: bytes, in_stream: bool) -> m.Message | None:
    try:
        return decode_message(data, in_stream)
    except DecodeError as exc:
        assert exc.offset is not None and 0 <= exc.offset <= len(data)
        assert str(exc)
        return None


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=64), st.booleans())
def test_random_bytes_decode_or_fail_cleanly(data: bytes, in_stream: bool) -> None:
    _decode_or_error(data, in_stream)


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(sorted(PARSERS)), st.binary(max_size=80), st.booleans())
def test_every_tag_with_random_body(tag: int, body: bytes, in_stream: bool) -> None:
    _decode_or_error(bytes([tag]) + body, in_stream)


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(SEEDS), st.data())
def test_mutated_real_messages(seed: bytes, data: st.DataObject) -> None:
    mutated = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 4))):
        choice = data.draw(st.integers(0, 2))
        position = data.draw(st.integers(0, max(0, len(mutated) - 1)))
        if choice == 0 and mutated:
            mutated[position] = data.draw(st.integers(0, 255))
        elif choice == 1 and mutated:
            del mutated[position]
        else:
            mutated.insert(position, data.draw(st.integers(0, 255)))
    message = _decode_or_error(bytes(mutated), False)
    if isinstance(message, m.Insert):
        # A decode that succeeds accounted for every byte: its values re-encode to the same message.
        values = b"".join(bytes([k]) + (struct.pack("!i", len(v)) + v if v is not None else b"")
                          for k, v in zip(message.new.kinds, message.new.values, strict=True))
        assert bytes(mutated) == (b"I" + struct.pack("!I", message.relation_oid) + b"N"
                                  + struct.pack("!h", len(message.new)) + values)


@given(st.integers(0, len(INSERT) - 1))
def test_every_truncation_names_its_offset(cut: int) -> None:
    try:
        decode_message(INSERT[:cut])
    except DecodeError as exc:
        assert exc.offset is not None and exc.offset <= cut
        assert "truncated" in str(exc) or "empty" in str(exc)
    else:
        raise AssertionError(f"a {cut}-byte prefix decoded")


def test_seeds_decode_to_their_fields() -> None:
    insert = decode_message(INSERT)
    assert isinstance(insert, m.Insert) and insert.new.kinds == b"tnu" and insert.new.values == (b"42", None, None)
    assert insert.new.unchanged_columns() == (2,)
    update = decode_message(UPDATE_K)
    assert isinstance(update, m.Update) and update.old_kind == "K" and update.new.kinds == b"b"
    relation = decode_message(RELATION)
    assert isinstance(relation, m.Relation) and relation.key_columns == ("id",)
    assert decode_message(COMMIT_PREPARED) == m.CommitPrepared(0, 0x10, 0x20, 5, 700, "gid-1")
    assert decode_message(SEEDS[6]) == m.StreamAbort(9, 10)
    assert decode_message(SEEDS[7]) == m.StreamAbort(9, 9, 0x30, 1)
    streamed_insert = INSERT[:1] + struct.pack("!I", 77) + INSERT[1:]
    assert decode_message(streamed_insert, in_stream=True) == m.Insert(77, 16384, insert.new)


def test_stream_state_is_tracked() -> None:
    decoder = PgOutputDecoder()
    decoder.decode(SEEDS[4])
    assert decoder.in_stream
    try:
        decoder.decode(SEEDS[4])
    except DecodeError as exc:
        assert "Stream Start inside" in str(exc)
    decoder.decode(b"E")
    assert not decoder.in_stream
