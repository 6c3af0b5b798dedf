"""``COPY ... TO STDOUT`` in text format -> each row's values as spans over one buffer.

The format (PostgreSQL's documentation of COPY, "Text Format"): one row per line, ended by a
newline; columns split by a tab; NULL written ``\\N``; a backslash escapes the rest (``\\b \\f \\n
\\r \\t \\v``, ``\\\\``, octal ``\\ooo``, hex ``\\xhh``, and any other character as itself). Data
holds tabs and newlines only escaped, so every raw tab or newline is a delimiter: rows and columns
are found by one vector search, and only the values holding a backslash are unescaped, one by one.
The values stay bytes in the connection's encoding (the snapshot sets UTF8), never Python strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cdc_apply.errors import CdcApplyError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.tuple_columns import gather_values

_TAB, _NEWLINE, _BACKSLASH, _N = 9, 10, 92, ord("N")
_ESCAPE = re.compile(rb"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|(.))", re.DOTALL)
_SIMPLE = {b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v"}


@dataclass
class CopyRows:
    """Rows of a COPY: value ``[row, column]`` is ``buf[starts:starts + lengths]``, or NULL."""

    buf: np.ndarray  # uint8: the COPY data, then the unescaped form of each value that had escapes
    is_null: np.ndarray  # (rows, columns) bool
    starts: np.ndarray  # (rows, columns) int64
    lengths: np.ndarray  # (rows, columns) int64

    def __len__(self) -> int:
        return len(self.is_null)

    def columns(self) -> list[pa.Array]:
        """Each column's values as one binary array, null for NULL."""
        kinds = np.where(self.is_null, m.KIND_NULL, m.KIND_TEXT)
        return [gather_values(self.buf, kinds[:, i], self.starts[:, i], self.lengths[:, i])
                for i in range(self.is_null.shape[1])]

    def text(self, row: int, column: int) -> str | None:
        if self.is_null[row, column]:
            return None
        start = int(self.starts[row, column])
        return self.buf[start:start + int(self.lengths[row, column])].tobytes().decode()


def parse_copy_text(data: bytes, columns: int, where: Callable[[int], str]) -> CopyRows:
    """``data``: whole rows of a text-format COPY of ``columns`` columns. ``where(row)`` names a row
    for an error: a row with another number of columns, a cut-short row, or a dangling backslash."""
    buf = np.frombuffer(data, np.uint8)
    if len(buf) and buf[-1] != _NEWLINE:
        raise CdcApplyError(f"{where(int(np.count_nonzero(buf == _NEWLINE)))}: the COPY data ends inside a row")
    delimiters = np.flatnonzero((buf == _TAB) | (buf == _NEWLINE))
    at_newline = buf[delimiters] == _NEWLINE
    rows = int(np.count_nonzero(at_newline))
    per_row = max(columns, 1)  # a row of no columns is an empty line
    if len(delimiters) != rows * per_row or not np.all(at_newline.reshape(-1, per_row)[:, -1] if rows else True):
        row_of = np.cumsum(at_newline) - at_newline
        tabs = np.bincount(row_of[~at_newline], minlength=rows)
        bad = int(np.argmax(tabs != per_row - 1))
        raise CdcApplyError(f"{where(bad)}: the COPY row has {tabs[bad] + 1} columns, the table {columns}")
    if columns == 0:
        empty = np.zeros((rows, 0), np.int64)
        return CopyRows(buf, empty.astype(bool), empty, empty)
    ends = delimiters.reshape(rows, columns).astype(np.int64)
    starts = np.empty_like(ends)
    starts[:, 1:] = ends[:, :-1] + 1
    starts[:, 0] = np.concatenate(([0], ends[:-1, -1] + 1))
    lengths = ends - starts
    # A field starts at or before its delimiter, so within buf; the byte after it may not be.
    is_null = (lengths == 2) & (buf[starts] == _BACKSLASH) & (buf[np.minimum(starts + 1, len(buf) - 1)] == _N)
    escaped = _fields_with_backslash(buf, starts, is_null)
    if not len(escaped):
        return CopyRows(buf, is_null, starts, lengths)
    extra = bytearray()
    flat_starts, flat_lengths = starts.reshape(-1), lengths.reshape(-1)
    for field in escaped.tolist():
        start = int(flat_starts[field])
        value = unescape(data[start:start + int(flat_lengths[field])], lambda: where(field // columns))
        flat_starts[field] = len(data) + len(extra)
        flat_lengths[field] = len(value)
        extra += value
    return CopyRows(np.frombuffer(data + bytes(extra), np.uint8), is_null, starts, lengths)


def _fields_with_backslash(buf: np.ndarray, starts: np.ndarray, is_null: np.ndarray) -> np.ndarray:
    """Flat indexes of the non-NULL fields holding a backslash (never a delimiter, so always inside
    the field that starts last before it)."""
    slashes = np.flatnonzero(buf == _BACKSLASH)
    fields = np.unique(np.searchsorted(starts.reshape(-1), slashes, side="right") - 1)
    return fields[~is_null.reshape(-1)[fields]]


def unescape(raw: bytes, where: Callable[[], str]) -> bytes:
    if raw.endswith(b"\\") and (len(raw) - len(raw.rstrip(b"\\"))) % 2:
        raise CdcApplyError(f"{where()}: a COPY value ends in a lone backslash")

    def replace(match: re.Match[bytes]) -> bytes:
        octal, hexadecimal, other = match.groups()
        if octal is not None:
            return bytes([int(octal, 8) & 0xFF])
        if hexadecimal is not None:
            return bytes([int(hexadecimal, 16)])
        return _SIMPLE.get(other, other)

    return _ESCAPE.sub(replace, raw)
