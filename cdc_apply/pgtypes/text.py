"""Character types, bytea, uuid, json, jsonb, xml, and custom types named by Type messages."""

from __future__ import annotations

import base64
import uuid

from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed, register
from cdc_apply.pgtypes.vectorized import cast_text, utf8_binary


def _text(text: str, typmod: int) -> str:
    return text


def _utf8(raw: bytes, typmod: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueConversionError(f"text value is not valid UTF-8 at byte {exc.start}") from None


for _oid, _name, _array in ((25, "text", 1009), (1043, "varchar", 1015), (1042, "bpchar", 1014),
                            (19, "name", 1003), (18, "char", 1002), (114, "json", 199)):
    register(PgType(_oid, _name, fixed("string"), _text, _utf8, array_oid=_array, vector_text=cast_text,
                    vector_binary=utf8_binary))
register(PgType(142, "xml", fixed("string"), _text, _utf8, array_oid=143))


def _jsonb_binary(raw: bytes, typmod: int) -> str:
    if not raw or raw[0] != 1:
        raise ValueConversionError("binary jsonb must start with version byte 1")
    return _utf8(raw[1:], typmod)


register(PgType(3802, "jsonb", fixed("string"), _text, _jsonb_binary, array_oid=3807))


def bytea_from_text(text: str, typmod: int = -1) -> bytes:
    """Both bytea_output formats: hex (\\x...) and escape (octal \\nnn, \\\\)."""
    if text.startswith("\\x"):
        try:
            return bytes.fromhex(text[2:])
        except ValueError:
            raise ValueConversionError("malformed hex bytea") from None
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
        elif text[i + 1:i + 2] == "\\":
            out.append(0x5C)
            i += 2
        elif len(text) >= i + 4 and all(c in "01234567" for c in text[i + 1:i + 4]):
            out.append(int(text[i + 1:i + 4], 8) & 0xFF)
            i += 4
        else:
            raise ValueConversionError(f"malformed escape bytea at character {i}")
    return bytes(out)


def _bytes(raw: bytes, typmod: int) -> bytes:
    return raw


def _bytes_json(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


register(PgType(17, "bytea", fixed("binary"), bytea_from_text, _bytes, _bytes_json, array_oid=1001))


def _uuid_text(text: str, typmod: int) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise ValueConversionError(f"not a uuid: {text!r}") from None


def _uuid_binary(raw: bytes, typmod: int) -> str:
    if len(raw) != 16:
        raise ValueConversionError(f"binary uuid must be 16 bytes, got {len(raw)}")
    return str(uuid.UUID(bytes=raw))


register(PgType(2950, "uuid", fixed("string"), _uuid_text, _uuid_binary, array_oid=2951))


def custom_from_binary(raw: bytes, typmod: int) -> str:
    """A non-built-in type in binary mode without the catalog's facts about it (a capture recorded
    before they were kept): an enum sends its label; anything else cannot be read blind."""
    if b"\x00" in raw:
        raise ValueConversionError(
            "binary value of a custom (non-built-in) type is not an enum label, and the capture holds no catalog "
            "facts about the type: capture again with cdc-apply capture (which records them), or use the "
            "publication in text mode (binary=false)")
    return _utf8(raw, typmod)


def custom_type(oid: int, name: str) -> PgType:
    """Custom types (enums, domains, ...) named by Type messages travel as their text form."""
    return PgType(oid, name, fixed("string"), _text, custom_from_binary)
