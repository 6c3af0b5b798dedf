"""Vector converters: a whole column of raw values -> one Arrow array. Each type's vector
converters are registered with its scalar ones, in its family module (``PgType.vector_text`` /
``vector_binary``); this module holds their contract, the helpers they share and the dispatch.

Invariant: a vector converter gives exactly what the type's scalar converter (``PgType.from_text``
/ ``from_binary``) gives, value for value (tests/test_golden_capture.py and tests/test_type_roundtrip.py check it on real captures).
It covers only the grammar PostgreSQL prints for ordinary values; on anything else (BC dates,
infinities, NaN in a decimal, a wrong binary width) it raises ``VectorFallback`` or an Arrow
error, and the caller converts that column with the scalar converter instead, which applies the
type's documented rule or raises the documented error. So no value is ever changed silently.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.bigendian import read_uint
from cdc_apply.pgtypes.registry import PgType, VectorConverter


class VectorFallback(Exception):
    """This column holds a value outside the vector converter's grammar: use the scalar one."""


FALLBACK_ERRORS = (VectorFallback, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError,
                   OverflowError)


def cast_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    """Arrow's own cast: for types whose output grammar Arrow reads exactly (integers, ISO dates)."""
    return pc.cast(strings, arrow)


def utf8_binary(raw: pa.Array, arrow: pa.DataType) -> pa.Array:
    """The binary form of the character types is their UTF-8 text."""
    return pc.cast(raw.cast(pa.large_string()), arrow)


def require_grammar(strings: pa.Array, pattern: str, what: str) -> None:
    values = strings.drop_null()
    if len(values) and not pc.all(pc.match_substring_regex(values, pattern)).as_py():
        raise VectorFallback(f"{what} outside PostgreSQL's output grammar")


def fixed_width(dtype: str, shift: int = 0, sentinels: tuple[int, ...] = ()) -> VectorConverter:
    """Binary fixed-width values (network byte order), plus ``shift`` (an epoch change)."""
    wire = np.dtype(dtype)

    def convert(raw: pa.Array, arrow: pa.DataType) -> pa.Array:
        data, starts, sizes, present = present_values(raw)
        if np.any(sizes[present] != wire.itemsize):
            raise VectorFallback(f"binary value not {wire.itemsize} bytes")
        first = int(starts[0]) if len(starts) else 0
        values = np.frombuffer(data, wire, int(present.sum()), first).astype(wire.newbyteorder("="))
        if sentinels and np.isin(values, sentinels).any():
            raise VectorFallback("infinity sentinel")
        if wire.kind == "u" and wire.itemsize == 1:
            values = values != 0  # bool: any non-zero byte is true, as struct's "?" reads it
        elif shift:
            if np.any(values > np.iinfo(values.dtype).max - shift):
                raise VectorFallback("value past the range the epoch shift keeps")
            values = values + values.dtype.type(shift)
        if present.all():
            return pa.array(values, type=arrow)
        full = np.zeros(len(raw), dtype=values.dtype)
        full[present] = values
        return pa.array(full, type=arrow, mask=~present)

    return convert


def present_values(raw: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, start, size, present mask) of a large_binary array's values."""
    offsets = np.frombuffer(raw.buffers()[1], np.int64, len(raw) + 1, raw.offset * 8)
    data = np.frombuffer(raw.buffers()[2], np.uint8) if raw.buffers()[2] is not None else np.zeros(0, np.uint8)
    present = ~np.asarray(raw.is_null(), dtype=bool)
    return data, offsets[:-1], np.diff(offsets), present


def read_int(data: np.ndarray, positions: np.ndarray, width: int, signed: bool) -> np.ndarray:
    value = read_uint(data, positions, width)
    if signed:
        value = np.where(value >= 1 << (8 * width - 1), value - (1 << (8 * width)), value)
    return value


def convert_text(pg_type: PgType, strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    """``strings``: large_string values of one column. Raises one of FALLBACK_ERRORS to fall back."""
    if pg_type.vector_text is None:
        raise VectorFallback(f"no text vector converter for {pg_type.name}")
    return pg_type.vector_text(strings, arrow)


def convert_binary(pg_type: PgType, raw: pa.Array, arrow: pa.DataType) -> pa.Array:
    """``raw``: large_binary values of one column. Raises one of FALLBACK_ERRORS to fall back."""
    if pg_type.vector_binary is None:
        raise VectorFallback(f"no binary vector converter for {pg_type.name}")
    return pg_type.vector_binary(raw, arrow)
