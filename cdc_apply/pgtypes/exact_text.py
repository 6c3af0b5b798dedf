"""A column kept as PostgreSQL's exact text (``tables.<t>.columns.<c>.type: string`` in the config).

For values the mapped type cannot hold: NaN or ±Infinity in a ``numeric(p,s)``, a multi-dimensional
array. Text-format values are the text itself. Binary-format values are rendered as PostgreSQL's
output function would print them: the types whose carried value prints otherwise (numeric, bytea,
floats, money in the C locale, interval in IntervalStyle postgres) by their own renderer
(``_BINARY_AS_TEXT``), arrays as array literals of their elements, other types by their JSON
rendering, which is their text (docs/types.md). Floats print the shortest text that reads back as
the same value, which may differ from PostgreSQL's only in spelling (``1000000000000000`` for ``1e+15``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

from cdc_apply.pgtypes.datetime import interval_from_binary
from cdc_apply.pgtypes.numbers import numeric_binary_to_text
from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed

NUMERIC_OID = 1700
EXACT_TEXT_OID = -1  # not a real type; it has no vector converters, so values take the scalar path


def _float_text(value: float) -> str:
    """float4out/float8out's spelling of the special values; integral values without Python's '.0'."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


def _float4_text(value: float) -> str:
    if not math.isfinite(value):
        return _float_text(value)
    for digits in range(1, 10):  # the shortest decimal that reads back as this float4
        text = f"{value:.{digits}g}"
        if struct.unpack("!f", struct.pack("!f", float(text)))[0] == value:
            return _float_text(float(text)) if "e" not in text else text  # exponents of 2+ digits, as float4out
    return _float_text(value)


def _money_binary(raw: bytes, typmod: int) -> str:
    """cash_out in the C locale (lc_monetary = 'C'): -$1,234,567.89."""
    if len(raw) != 8:
        raise ValueConversionError(f"binary money must be 8 bytes, got {len(raw)}")
    cents = struct.unpack("!q", raw)[0]
    return f"{'-' if cents < 0 else ''}${abs(cents) // 100:,}.{abs(cents) % 100:02d}"


def _interval_binary(raw: bytes, typmod: int) -> str:
    """interval_out under IntervalStyle postgres (EncodeInterval): 1 year 2 mons 3 days 04:05:06.789."""
    value = interval_from_binary(raw)
    months, days, micros = value["months"], value["days"], value["microseconds"]
    parts: list[str] = []
    before = False  # the last field printed was negative: a positive one after it gets a '+'
    for amount, unit in ((int(months / 12), "year"), (int(math.fmod(months, 12)), "mon"), (days, "day")):
        if amount:
            parts.append(f"{'+' if before and amount > 0 else ''}{amount} {unit}{'' if amount == 1 else 's'}")
            before = amount < 0
    if micros or not parts:
        sign = "-" if micros < 0 else "+" if before else ""
        hours, rest = divmod(abs(micros), 3_600_000_000)
        minutes, rest = divmod(rest, 60_000_000)
        seconds, fraction = divmod(rest, 1_000_000)
        text = f"{sign}{hours:02d}:{minutes:02d}:{seconds:02d}"
        parts.append(text + (f".{fraction:06d}".rstrip("0") if fraction else ""))
    return " ".join(parts)


# Types whose carried value does not print as PostgreSQL prints it (their to_json is not their text).
_BINARY_AS_TEXT: dict[int, Callable[[bytes, int], str]] = {
    NUMERIC_OID: lambda raw, typmod: numeric_binary_to_text(raw),
    17: lambda raw, typmod: "\\x" + raw.hex(),  # bytea_output = hex
    700: lambda raw, typmod: _float4_text(struct.unpack("!f", raw)[0]) if len(raw) == 4 else _bad_width(raw, 4),
    701: lambda raw, typmod: _float_text(struct.unpack("!d", raw)[0]) if len(raw) == 8 else _bad_width(raw, 8),
    790: _money_binary,
    1186: _interval_binary,
}


def _bad_width(raw: bytes, width: int) -> str:
    raise ValueConversionError(f"binary value must be {width} bytes, got {len(raw)}")


def _element_text(value: Any) -> str:
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return str(value)


def _quoted(text: str) -> str:
    """array_out's quoting: empty, NULL, or holding a delimiter, brace, quote, backslash or space."""
    if text == "" or text.upper() == "NULL" or any(c in text for c in '{},"\\ \t\n\r\v\f'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def array_literal(value: list[Any]) -> str:
    parts = []
    for item in value:
        if item is None:
            parts.append("NULL")
        elif isinstance(item, list):
            parts.append(array_literal(item))
        else:
            parts.append(_quoted(_element_text(item)))
    return "{" + ",".join(parts) + "}"


def exact_text_type(original: PgType) -> PgType:
    def from_text(text: str, typmod: int) -> str:
        return text

    def from_binary(raw: bytes, typmod: int) -> str:
        as_text = _BINARY_AS_TEXT.get(original.oid)
        if as_text is not None:
            return as_text(raw, typmod)
        rendered = original.to_json(original.from_binary(raw, typmod))
        return array_literal(rendered) if isinstance(rendered, list) else _element_text(rendered)

    return PgType(EXACT_TEXT_OID, f"{original.name} as text", fixed("string"), from_text, from_binary)
