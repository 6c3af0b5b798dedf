from __future__ import annotations

import struct

import pytest

from cdc_apply.errors import DecodeError
from cdc_apply.lsn import format_lsn, parse_lsn
from cdc_apply.pgoutput.framing import (
    Keepalive, XLogData, decode_copy_data, encode_keepalive, encode_standby_status, encode_xlogdata,
)


def test_xlogdata_and_keepalive_round_trip() -> None:
    frame = encode_xlogdata(0x1_0000_0010, 0x1_0000_0020, 123, b"B...")
    assert decode_copy_data(frame) == XLogData(0x1_0000_0010, 0x1_0000_0020, 123, b"B...")
    assert decode_copy_data(encode_keepalive(0x55, 9, True)) == Keepalive(0x55, 9, True)


def test_standby_status_layout() -> None:
    frame = encode_standby_status(1, 2, 3, 4, reply_requested=True)
    assert frame[:1] == b"r" and len(frame) == 34
    assert struct.unpack("!QQQqB", frame[1:]) == (1, 2, 3, 4, 1)


@pytest.mark.parametrize("frame", [b"", b"w" + b"\0" * 10, b"k" + b"\0" * 5, b"z123"])
def test_bad_frames_fail_cleanly(frame: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_copy_data(frame)


def test_lsn_text_round_trip() -> None:
    assert format_lsn(parse_lsn("16/B374D848")) == "16/B374D848"
    assert parse_lsn("0/1D525F0") == 0x1D525F0
    with pytest.raises(ValueError):
        parse_lsn("nope")
