"""bool, integers, oid, floating point, numeric and money."""

from __future__ import annotations

import math
import re
import struct
from decimal import Context, Decimal, InvalidOperation

from cdc_apply.pgtypes.registry import (
    PgType, UnrepresentableValueError, ValueConversionError, fixed, register,
)

SPARK_MAX_DECIMAL_PRECISION = 38
_WIDE = Context(prec=2 * SPARK_MAX_DECIMAL_PRECISION)
NUMERIC_SPECIALS = {0xC000: "NaN", 0xD000: "Infinity", 0xF000: "-Infinity"}


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


register(PgType(16, "bool", fixed("boolean"), _bool_text, _struct_reader("!?", "bool"), array_oid=1000))
register(PgType(21, "int2", fixed("smallint"), _int_reader("int2", -2**15, 2**15 - 1), _struct_reader("!h", "int2"),
                array_oid=1005))
register(PgType(23, "int4", fixed("int"), _int_reader("int4", -2**31, 2**31 - 1), _struct_reader("!i", "int4"),
                array_oid=1007))
register(PgType(20, "int8", fixed("bigint"), _int_reader("int8", -2**63, 2**63 - 1), _struct_reader("!q", "int8"),
                array_oid=1016))
register(PgType(26, "oid", fixed("bigint"), _int_reader("oid", 0, 2**32 - 1), _struct_reader("!I", "oid"),
                array_oid=1028))
register(PgType(28, "xid", fixed("bigint"), _int_reader("xid", 0, 2**32 - 1), _struct_reader("!I", "xid"),
                array_oid=1011))
register(PgType(700, "float4", fixed("float"), _float4_text, _struct_reader("!f", "float4"), _float_json,
                array_oid=1021))
register(PgType(701, "float8", fixed("double"), _float_text, _struct_reader("!d", "float8"), _float_json,
                array_oid=1022))


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
            f"numeric value {text} does not fit Spark decimal (column typmod {typmod}); "
            "map the column to string to keep it")
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
                array_oid=1231))


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
