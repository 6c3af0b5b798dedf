"""A column kept as PostgreSQL's exact text (``tables.<t>.columns.<c>.type: string`` in the config).

For values the mapped type cannot hold: NaN or ±Infinity in a ``numeric(p,s)``, a multi-dimensional
array. Text-format values are the text itself. Binary-format values are rendered as PostgreSQL's
output function would print them: numeric exactly; arrays as array literals of their elements;
other types by their JSON rendering (docs/types.md).
"""

from __future__ import annotations

import math
from typing import Any

from cdc_apply.pgtypes.numbers import numeric_binary_to_text
from cdc_apply.pgtypes.registry import PgType, fixed

NUMERIC_OID = 1700
EXACT_TEXT_OID = -1  # not a real type; it has no vector converters, so values take the scalar path


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
        if original.oid == NUMERIC_OID:
            return numeric_binary_to_text(raw)
        rendered = original.to_json(original.from_binary(raw, typmod))
        return array_literal(rendered) if isinstance(rendered, list) else _element_text(rendered)

    return PgType(EXACT_TEXT_OID, f"{original.name} as text", fixed("string"), from_text, from_binary)
