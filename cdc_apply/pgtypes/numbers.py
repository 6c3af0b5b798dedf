"""bool, integers, oid, floating point, numeric and money."""

from __future__ import annotations

import math
import re
import struct
from decimal import Context, Decimal, InvalidOperation

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.pgtypes.registry import (
    PgType, UnrepresentableValueError, ValueConversionError, fixed, register,
)
from cdc_apply.pgtypes.vectorized import VectorFallback, cast_text, fixed_width, present_values, read_int, require_grammar

SPARK_MAX_DECIMAL_PRECISION = 38
_WIDE = Context(prec=2 * SPARK_MAX_DECIMAL_PRECISION)
NUMERIC_SPECIALS = {0xC000: "NaN", 0xD000: "Infinity", 0xF000: "-Infinity"}


# Vector converters (a column at a time; contract in pgtypes/vectorized.py) ----------------------

# float8out's output; Arrow alone also reads "+1", "inf" and "nan", which the scalar converter refuses.
_FLOAT_GRAMMAR = r"^(-?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?|NaN|-?Infinity)$"


def _float8_column_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    require_grammar(strings, _FLOAT_GRAMMAR, "float text")
    values = pc.cast(strings, arrow)
    _refuse_overflow(strings, values)
    return values


def _refuse_overflow(strings: pa.Array, values: pa.Array) -> None:
    """Text such as 1e400 reads as infinity: let the scalar converter refuse it."""
    infinite = pc.and_(pc.is_inf(values), pc.invert(pc.match_substring(strings, "Infinity")))
    if pc.any(infinite).as_py():
        raise VectorFallback("float text out of range")


def _numeric_column_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    if not pa.types.is_decimal(arrow):
        return strings.cast(arrow)  # numeric kept as its exact text
    # Only numeric_out's plain digits reach Arrow's cast: pyarrow 26 crashes the process (SIGSEGV)
    # casting "1e-9999999" to a decimal, and an exponent is never what PostgreSQL sends.
    require_grammar(strings, r"^-?[0-9]+(\.[0-9]+)?$", "numeric text")
    return pc.cast(strings, arrow)


def _bool_column_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    values = strings.drop_null()
    if len(values) and not pc.all(pc.is_in(values, value_set=pa.array(["t", "f"], pa.large_string()))).as_py():
        raise VectorFallback("boolean text other than t/f")
    return pc.equal(strings, "t")


def _float4_column_text(strings: pa.Array, arrow: pa.DataType) -> pa.Array:
    # Through double first, as the scalar converter rounds: text -> float64 -> float32.
    doubles = _float8_column_text(strings, pa.float64())
    singles = pc.cast(doubles, pa.float32())
    _refuse_overflow(strings, singles)
    return singles


MAX_INT64_DECIMAL_PRECISION = 18


def _numeric_column_binary(raw: pa.Array, arrow: pa.DataType) -> pa.Array:
    """numeric_send's base-10000 digits -> decimal(p,s) for p <= 18, exactly (else fall back)."""
    if not pa.types.is_decimal(arrow) or arrow.precision > MAX_INT64_DECIMAL_PRECISION:
        raise VectorFallback("numeric kept as text, or wider than int64")
    data, starts, sizes, present = present_values(raw)
    starts, sizes = starts[present], sizes[present]
    if np.any(sizes < 8):
        raise VectorFallback("short binary numeric")
    ndigits, weight = read_int(data, starts, 2, True), read_int(data, starts + 2, 2, True)
    sign, dscale = read_int(data, starts + 4, 2, False), read_int(data, starts + 6, 2, False)
    if np.any((sign != 0) & (sign != 0x4000)) or np.any(ndigits < 0) or np.any(sizes != 8 + 2 * ndigits):
        raise VectorFallback("special or malformed binary numeric")
    if np.any(dscale != arrow.scale):  # a numeric(p,s) column's values always carry display scale s
        raise VectorFallback("display scale differs from the column's scale")
    unscaled = np.zeros(len(starts), np.int64)
    for k in range(int(ndigits.max()) if len(ndigits) else 0):
        has = k < ndigits
        digit = np.where(has, read_int(data, starts + 8 + 2 * k, 2, False), 0)
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


def _struct_reader(fmt: str, name: str):  # type: ignore[no-untyped-def]
    layout = struct.Struct(fmt)

    def read(raw: bytes, typmod: int):  # type: ignore[no-untyped-def]
        if len(raw) != layout.size:
            raise ValueConversionError(f"binary {name} must be {layout.size} bytes, got {len(raw)}")
        return layout.unpack(raw)[0]

    return read


_INTEGER_TEXT = re.compile(r"-?[0-9]+")


def _int_reader(name: str, low: int, high: int):  # type: ignore[no-untyped-def]
    """int4out's grammar only (Python's int() also takes " 12 ", "1_000" and "+5"), in the type's range."""

    def read(text: str, typmod: int) -> int:
        if len(text) > 20 or not _INTEGER_TEXT.fullmatch(text):
            raise ValueConversionError(f"not an {name}: {text[:40]!r}")
        value = int(text)
        if not low <= value <= high:
            raise ValueConversionError(f"{name} value {text} out of range")
        return value

    return read


def _bool_text(text: str, typmod: int) -> bool:
    if text in ("t", "true"):
        return True
    if text in ("f", "false"):
        return False
    raise ValueConversionError(f"not a boolean: {text!r}")


# float8out's grammar: Python's float() also takes " 1 ", "1_0", "+1" and "inf", which PostgreSQL never prints.
_FLOAT_TEXT = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|NaN|-?Infinity")


def _float_text(text: str, typmod: int) -> float:
    if not _FLOAT_TEXT.fullmatch(text):
        raise ValueConversionError(f"not a floating-point value: {text[:40]!r}")
    value = float(text)  # Python reads NaN, Infinity, -Infinity and -0 as PostgreSQL prints them
    if math.isinf(value) and not text.endswith("Infinity"):
        raise ValueConversionError(f"floating-point value {text[:40]} out of range")
    return value


_FLOAT4 = struct.Struct("!f")


def _float4_text(text: str, typmod: int) -> float:
    """Rounded to single precision, the value a float4 column (and Spark's FloatType) holds."""
    value = _float_text(text, typmod)
    try:
        single = _FLOAT4.unpack(_FLOAT4.pack(value))[0]
    except OverflowError:
        single = math.inf
    if math.isinf(single) and not math.isinf(value):
        raise ValueConversionError(f"float4 value {text[:40]} out of range")
    return single


def _float_json(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


register(PgType(16, "bool", fixed("boolean"), _bool_text, _struct_reader("!?", "bool"), array_oid=1000,
                vector_text=_bool_column_text, vector_binary=fixed_width("u1")))
register(PgType(21, "int2", fixed("smallint"), _int_reader("int2", -2**15, 2**15 - 1), _struct_reader("!h", "int2"),
                array_oid=1005, vector_text=cast_text,
                vector_binary=fixed_width(">i2")))
register(PgType(23, "int4", fixed("int"), _int_reader("int4", -2**31, 2**31 - 1), _struct_reader("!i", "int4"),
                array_oid=1007, vector_text=cast_text,
                vector_binary=fixed_width(">i4")))
register(PgType(20, "int8", fixed("bigint"), _int_reader("int8", -2**63, 2**63 - 1), _struct_reader("!q", "int8"),
                array_oid=1016, vector_text=cast_text,
                vector_binary=fixed_width(">i8")))
register(PgType(26, "oid", fixed("bigint"), _int_reader("oid", 0, 2**32 - 1), _struct_reader("!I", "oid"),
                array_oid=1028, vector_text=cast_text,
                vector_binary=fixed_width(">u4")))
register(PgType(28, "xid", fixed("bigint"), _int_reader("xid", 0, 2**32 - 1), _struct_reader("!I", "xid"),
                array_oid=1011, vector_text=cast_text,
                vector_binary=fixed_width(">u4")))
register(PgType(700, "float4", fixed("float"), _float4_text, _struct_reader("!f", "float4"), _float_json,
                array_oid=1021, vector_text=_float4_column_text,
                vector_binary=fixed_width(">f4")))
register(PgType(701, "float8", fixed("double"), _float_text, _struct_reader("!d", "float8"), _float_json,
                array_oid=1022, vector_text=_float8_column_text,
                vector_binary=fixed_width(">f8")))


# numeric -------------------------------------------------------------------------------------
# numeric(p,s) with p <= 38 -> decimal(p,s); NaN/±Infinity there cannot be held: error.
# numeric without a typmod, or p > 38 -> string with PostgreSQL's exact text.

def numeric_precision_scale(typmod: int) -> tuple[int, int] | None:
    if typmod < 4:
        return None
    packed = typmod - 4
    precision, scale = (packed >> 16) & 0xFFFF, packed & 0xFFFF
    if scale & 0x400:  # PG 15+ allows negative scale, stored as 11-bit two's complement
        scale -= 0x800
    return precision, scale


def _numeric_is_decimal(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) of a numeric(p,s) a Spark decimal holds; None keeps PostgreSQL's text
    (no typmod, p > 38, a negative scale, or a typmod PostgreSQL never makes, such as p = 0)."""
    ps = numeric_precision_scale(typmod)
    if ps is None or not 1 <= ps[0] <= SPARK_MAX_DECIMAL_PRECISION or not 0 <= ps[1] <= ps[0]:
        return None
    return ps


def _numeric_spark_type(typmod: int) -> str:
    ps = _numeric_is_decimal(typmod)
    return f"decimal({ps[0]},{ps[1]})" if ps else "string"


# numeric_out's grammar for finite values: never an exponent, a "+", a space or an underscore.
NUMERIC_TEXT = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _numeric_value(text: str, typmod: int) -> Decimal | str:
    ps = _numeric_is_decimal(typmod)
    if ps is None:
        return text
    if text in ("NaN", "Infinity", "-Infinity"):
        raise UnrepresentableValueError(
            f"numeric value {text} does not fit Spark decimal (column typmod {typmod})")
    if not NUMERIC_TEXT.fullmatch(text):
        raise ValueConversionError(f"not a numeric: {text[:40]!r}")
    value = Decimal(text)
    if not _fits(value, *ps):
        raise ValueConversionError(f"numeric value {text} does not fit numeric({ps[0]},{ps[1]})")
    # Exactly the column's scale: Arrow misreads a Decimal whose digit count exceeds its precision.
    return value.quantize(Decimal(1).scaleb(-ps[1]), context=_WIDE)


def _fits(value: Decimal, precision: int, scale: int) -> bool:
    """No non-zero digit past ``scale`` and at most ``precision - scale`` integer digits."""
    _, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        return False
    extra_fraction = -exponent - scale
    if extra_fraction > 0 and any(digits[-extra_fraction:]):
        return False
    significant = list(digits)
    while significant and significant[0] == 0:
        significant.pop(0)
    return len(significant) + exponent <= precision - scale


def _numeric_text(text: str, typmod: int) -> Decimal | str:
    return _numeric_value(text, typmod)


_NUMERIC_HEADER = struct.Struct("!hhHH")


def numeric_binary_to_text(raw: bytes) -> str:
    """numeric_send's layout (ndigits, weight, sign, dscale, base-10000 digits) -> numeric_out's text."""
    if len(raw) < 8:
        raise ValueConversionError(f"binary numeric needs 8 header bytes, got {len(raw)}")
    ndigits, weight, sign, dscale = _NUMERIC_HEADER.unpack_from(raw)
    if sign in NUMERIC_SPECIALS:
        return NUMERIC_SPECIALS[sign]
    if sign not in (0x0000, 0x4000) or ndigits < 0 or len(raw) != 8 + 2 * ndigits:
        raise ValueConversionError("malformed binary numeric")
    digits = struct.unpack_from(f"!{ndigits}H", raw, 8)
    if any(d > 9999 for d in digits):
        raise ValueConversionError("malformed binary numeric digit")
    integer_groups = weight + 1
    padded = list(digits) + [0] * max(0, integer_groups - ndigits)
    int_part = "".join(f"{d:04d}" for d in padded[:max(integer_groups, 0)]).lstrip("0") or "0"
    frac_digits = "".join(f"{d:04d}" for d in ([0] * max(0, -integer_groups) + padded[max(integer_groups, 0):]))
    frac = (frac_digits + "0" * dscale)[:dscale]
    text = int_part + ("." + frac if dscale > 0 else "")
    return "-" + text if sign == 0x4000 else text


def _numeric_binary(raw: bytes, typmod: int) -> Decimal | str:
    return _numeric_value(numeric_binary_to_text(raw), typmod)


def _numeric_json(value: Decimal | str) -> str:
    return str(value)


register(PgType(1700, "numeric", _numeric_spark_type, _numeric_text, _numeric_binary, _numeric_json,
                array_oid=1231, vector_text=_numeric_column_text,
                vector_binary=_numeric_column_binary))


# money: decimal(19,2), assuming an lc_monetary with two fraction digits (C, en_US, ...) ---------

def _money_text(text: str, typmod: int) -> Decimal:
    negative = text.startswith("-") or (text.startswith("(") and text.endswith(")"))
    digits = "".join(ch for ch in text if ch.isdigit() or ch == ".")
    try:
        value = Decimal(digits)
    except InvalidOperation:
        raise ValueConversionError(f"not a money value: {text!r}") from None
    return -value if negative else value


def _money_binary(raw: bytes, typmod: int) -> Decimal:
    if len(raw) != 8:
        raise ValueConversionError(f"binary money must be 8 bytes, got {len(raw)}")
    return Decimal(struct.unpack("!q", raw)[0]).scaleb(-2)


register(PgType(790, "money", fixed("decimal(19,2)"), _money_text, _money_binary, _numeric_json,
                array_oid=791))
