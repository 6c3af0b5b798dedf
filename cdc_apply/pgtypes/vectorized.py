"""Vectorised converters by type OID: a whole column of raw values -> one Arrow array.

Invariant: a vector converter gives exactly what the type's scalar converter (``PgType.from_text``
/ ``from_binary``) gives, value for value (tests/test_golden_capture.py and tests/test_type_roundtrip.py check it on real captures).
It covers only the grammar PostgreSQL prints for ordinary values; on anything else (BC dates,
infinities, NaN in a decimal, a wrong binary width) it raises ``VectorFallback`` or an Arrow
error, and the caller converts that column with the scalar converter instead, which applies the
type's documented rule or raises the documented error. So no value is ever changed silently.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.lsn import PG_EPOCH_OFFSET_US
from cdc_apply.bigendian import read_uint
from cdc_apply.pgtypes.datetime import (
    DATE_NEG_INFINITY, DATE_POS_INFINITY, PG_EPOCH_DAYS, TIMESTAMP_NEG_INFINITY, TIMESTAMP_POS_INFINITY,
)


class VectorFallback(Exception):
    """This column holds a value outside the vector converter's grammar: use the scalar one."""


FALLBACK_ERRORS = (VectorFallback, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError,
                   OverflowError)

# (values as large_string or large_binary, the column's Arrow type) -> Arrow array of that type
VectorConverter = Callable[[pa.Array, pa.DataType], pa.Array]

TEXT: dict[int, VectorConverter] = {}
BINARY: dict[int, VectorConverter] = {}


def _cast(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    return pc.cast(strings, arrow)


def _require_grammar(strings: pa.Array, pattern: str, what: str) -> None:
    values = strings.drop_null()
    if len(values) and not pc.all(pc.match_substring_regex(values, pattern)).as_py():
        raise VectorFallback(f"{what} outside PostgreSQL's output grammar")


# float8out's output; Arrow alone also reads "+1", "inf" and "nan", which the scalar converter refuses.
_FLOAT_GRAMMAR = r"^(-?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?|NaN|-?Infinity)$"


def _float8_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    _require_grammar(strings, _FLOAT_GRAMMAR, "float text")
    values = pc.cast(strings, arrow)
    _refuse_overflow(strings, values)
    return values


def _refuse_overflow(strings: pa.Array, values: pa.Array) -> None:
    """Text such as 1e400 reads as infinity: let the scalar converter refuse it."""
    infinite = pc.and_(pc.is_inf(values), pc.invert(pc.match_substring(strings, "Infinity")))
    if pc.any(infinite).as_py():
        raise VectorFallback("float text out of range")


def _numeric_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    if not pa.types.is_decimal(arrow):
        return strings.cast(arrow)  # numeric kept as its exact text
    # Only numeric_out's plain digits reach Arrow's cast: pyarrow 26 crashes the process (SIGSEGV)
    # casting "1e-9999999" to a decimal, and an exponent is never what PostgreSQL sends.
    _require_grammar(strings, r"^-?[0-9]+(\.[0-9]+)?$", "numeric text")
    return pc.cast(strings, arrow)


def _bool_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    values = strings.drop_null()
    if len(values) and not pc.all(pc.is_in(values, value_set=pa.array(["t", "f"], pa.large_string()))).as_py():
        raise VectorFallback("boolean text other than t/f")
    return pc.equal(strings, "t")


def _float4_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    # Through double first, as the scalar converter rounds: text -> float64 -> float32.
    doubles = _float8_text(strings, pa.float64())
    singles = pc.cast(doubles, pa.float32())
    _refuse_overflow(strings, singles)
    return singles


def _fixed_width(dtype: str, shift: int = 0, sentinels: tuple[int, ...] = ()) -> VectorConverter:
    """Binary fixed-width values (network byte order), plus ``shift`` (an epoch change)."""
    wire = np.dtype(dtype)

    def convert(raw: pa.Array, arrow: pa.DataType) -> pa.Array:
        data, starts, sizes, present = _present_values(raw)
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


def _present_values(raw: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, start, size, present mask) of a large_binary array's values."""
    offsets = np.frombuffer(raw.buffers()[1], np.int64, len(raw) + 1, raw.offset * 8)
    data = np.frombuffer(raw.buffers()[2], np.uint8) if raw.buffers()[2] is not None else np.zeros(0, np.uint8)
    present = ~np.asarray(raw.is_null(), dtype=bool)
    return data, offsets[:-1], np.diff(offsets), present


MAX_INT64_DECIMAL_PRECISION = 18


def _numeric_binary(raw: pa.Array, arrow: pa.DataType) -> pa.Array:
    """numeric_send's base-10000 digits -> decimal(p,s) for p <= 18, exactly (else fall back)."""
    if not pa.types.is_decimal(arrow) or arrow.precision > MAX_INT64_DECIMAL_PRECISION:
        raise VectorFallback("numeric kept as text, or wider than int64")
    data, starts, sizes, present = _present_values(raw)
    starts, sizes = starts[present], sizes[present]
    if np.any(sizes < 8):
        raise VectorFallback("short binary numeric")
    ndigits, weight = _read_int(data, starts, 2, True), _read_int(data, starts + 2, 2, True)
    sign, dscale = _read_int(data, starts + 4, 2, False), _read_int(data, starts + 6, 2, False)
    if np.any((sign != 0) & (sign != 0x4000)) or np.any(ndigits < 0) or np.any(sizes != 8 + 2 * ndigits):
        raise VectorFallback("special or malformed binary numeric")
    if np.any(dscale != arrow.scale):  # a numeric(p,s) column's values always carry display scale s
        raise VectorFallback("display scale differs from the column's scale")
    unscaled = np.zeros(len(starts), np.int64)
    for k in range(int(ndigits.max()) if len(ndigits) else 0):
        has = k < ndigits
        digit = np.where(has, _read_int(data, starts + 8 + 2 * k, 2, False), 0)
        if np.any(digit > 9999):
            raise VectorFallback("malformed binary numeric digit")
        exponent = 4 * (weight - k) + arrow.scale
        if np.any(has & (digit != 0) & (exponent > MAX_INT64_DECIMAL_PRECISION)):
            raise VectorFallback("numeric past the decimal's precision")
        up = np.clip(exponent, 0, MAX_INT64_DECIMAL_PRECISION)
        down = np.clip(-exponent, 0, 4)
        if np.any(has & (digit % 10 ** down != 0)):
            raise VectorFallback("more fractional digits than the decimal's scale")
        unscaled += digit // 10 ** down * 10 ** up * (exponent > -4)
    if np.any(np.abs(unscaled) >= 10 ** arrow.precision):
        raise VectorFallback("numeric past the decimal's precision")
    unscaled = np.where(sign == 0x4000, -unscaled, unscaled)
    full = np.zeros((len(raw), 2), np.int64)
    full[present, 0] = unscaled
    full[:, 1] = full[:, 0] >> 63  # the 128-bit value's high word: sign extension
    validity = None if present.all() else pa.py_buffer(np.packbits(present, bitorder="little"))
    return pa.Array.from_buffers(arrow, len(raw), [validity, pa.py_buffer(full)], null_count=int((~present).sum()))


def _read_int(data: np.ndarray, positions: np.ndarray, width: int, signed: bool) -> np.ndarray:
    value = read_uint(data, positions, width)
    if signed:
        value = np.where(value >= 1 << (8 * width - 1), value - (1 << (8 * width)), value)
    return value


def _register_text(oids: tuple[int, ...], converter: VectorConverter) -> None:
    for oid in oids:
        TEXT[oid] = converter


STRING_OIDS = (25, 1043, 1042, 19, 18, 114)  # text, varchar, bpchar, name, "char", json
_register_text(STRING_OIDS, _cast)
_register_text((21, 23, 20, 26, 28), _cast)  # int2, int4, int8, oid, xid
_register_text((701,), _float8_text)  # Arrow reads NaN, Infinity, -Infinity and -0 as PostgreSQL prints them
_register_text((700,), _float4_text)
_register_text((16,), _bool_text)
_register_text((1082, 1114, 1184), _cast)  # date, timestamp, timestamptz: ISO, AD, finite only
_register_text((1700,), _numeric_text)  # numeric -> decimal(p,s) or its exact text

for _oid in STRING_OIDS:
    BINARY[_oid] = _cast  # the binary form of these types is their UTF-8 text
BINARY[16] = _fixed_width("u1")
BINARY[21] = _fixed_width(">i2")
BINARY[23] = _fixed_width(">i4")
BINARY[20] = _fixed_width(">i8")
BINARY[26] = _fixed_width(">u4")
BINARY[28] = _fixed_width(">u4")
BINARY[700] = _fixed_width(">f4")
BINARY[701] = _fixed_width(">f8")
BINARY[1082] = _fixed_width(">i4", PG_EPOCH_DAYS, (DATE_POS_INFINITY, DATE_NEG_INFINITY))
BINARY[1114] = _fixed_width(">i8", PG_EPOCH_OFFSET_US, (TIMESTAMP_POS_INFINITY, TIMESTAMP_NEG_INFINITY))
BINARY[1184] = BINARY[1114]
BINARY[1700] = _numeric_binary


def convert_text(oid: int, strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    """``strings``: large_string values of one column. Raises one of FALLBACK_ERRORS to fall back."""
    converter = TEXT.get(oid)
    if converter is None:
        raise VectorFallback(f"no text vector converter for type {oid}")
    return converter(strings, arrow)


def convert_binary(oid: int, raw: pa.Array, arrow: pa.DataType) -> pa.Array:
    """``raw``: large_binary values of one column. Raises one of FALLBACK_ERRORS to fall back."""
    converter = BINARY.get(oid)
    if converter is None:
        raise VectorFallback(f"no binary vector converter for type {oid}")
    if converter is _cast:
        return _cast(raw.cast(pa.large_string()), arrow)
    return converter(raw, arrow)
