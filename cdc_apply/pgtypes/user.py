"""Types a user defines (domains, enums, composites, arrays of them) in binary mode, from catalog facts.

pgoutput names such a type on the wire only by a Type message (namespace and name). Its binary
value is its base type's, its label, or ``record_send``'s fields, and reading it needs what only
the catalog knows. Those facts (``UserType``) travel as JSON text (``facts_json``): read from the
source when a Type message arrives live (``sources.catalog.SourceCatalog.type_facts``), recorded on
the Type message's row by ``cdc-apply capture``, and attached to the Type message by the assembler.

A user-defined type lands as what the text mode gives, so a table replays to the same Delta schema
in either mode (docs/types.md): PostgreSQL's text of the value (``string``), and ``array<string>``
of the elements' text for an array of a user-defined type. Binary values are rendered as
PostgreSQL's output functions print them: ``record_out``'s quoting for a composite, ``array_out``'s
for an array, the built-in type's own rendering (``exact_text``) for everything else.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from cdc_apply.pgtypes.arrays import decode_binary_array, parse_array_literal
from cdc_apply.pgtypes.exact_text import array_literal, exact_text_type
from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed, lookup
from cdc_apply.pgtypes.text import custom_from_binary

KINDS = ("domain", "enum", "composite", "array", "other")
MAX_DEPTH = 32  # domains over domains, composites in composites: deeper than any real schema
_INT32 = struct.Struct("!i")
_FIELD_HEADER = struct.Struct("!Ii")  # a composite field: type OID, length (-1: NULL)


@dataclass(frozen=True, slots=True)
class UserType:
    """What the catalog says about one user-defined type.

    ``base``: a domain's base type, an array's element type (0 otherwise). ``fields``: a composite's
    live attributes in order, as (name, type OID); dropped ones are left out, as ``record_send`` does.
    """

    oid: int
    name: str  # schema-qualified, for errors
    kind: str
    base: int = 0
    fields: tuple[tuple[str, int], ...] = ()


def facts_json(types: Iterable[UserType]) -> str:
    return json.dumps([{"oid": t.oid, "name": t.name, "kind": t.kind, "base": t.base,
                        "fields": [list(f) for f in t.fields]} for t in types], separators=(",", ":"))


@lru_cache(maxsize=256)
def parse_facts(text: str) -> Mapping[int, UserType]:
    """``facts_json``'s text -> OID -> UserType. Malformed facts (a hand-edited capture) raise
    ``ValueConversionError`` saying what is wrong."""
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            raise TypeError("a JSON list of types")
        types = {}
        for item in items:
            kind = item["kind"]
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
            fields = tuple((str(name), _oid(oid)) for name, oid in item.get("fields", ()))
            user = UserType(_oid(item["oid"]), str(item["name"]), kind, _oid(item.get("base", 0)), fields)
            types[user.oid] = user
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise ValueConversionError(f"malformed type facts ({type(exc).__name__}: {str(exc)[:200]})") from None
    return types


def _oid(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"a type OID must be a whole number from 0 to 2^32-1, got {str(value)[:40]!r}")
    return value


def user_type(oid: int, qualified: str, facts: Mapping[int, UserType]) -> PgType | None:
    """The type of a column whose Type message's facts are ``facts``; None if they do not hold ``oid``."""
    user = facts.get(oid)
    if user is None:
        return None
    if user.kind == "array":
        element = _element_type(user.base, facts, 1)

        def array_from_binary(raw: bytes, typmod: int) -> list[Any]:
            return decode_binary_array(raw, element, typmod)

        return PgType(oid, qualified, fixed("array<string>"), lambda text, typmod: parse_array_literal(text),
                      array_from_binary)

    def from_binary(raw: bytes, typmod: int) -> str:
        return binary_text(oid, raw, facts, 0)

    return PgType(oid, qualified, fixed("string"), lambda text, typmod: text, from_binary)


def _element_type(oid: int, facts: Mapping[int, UserType], depth: int) -> PgType:
    """An array element as its text: what an element of ``array<string>`` holds in text mode."""
    def from_binary(raw: bytes, typmod: int) -> str:
        return binary_text(oid, raw, facts, depth)

    return PgType(oid, f"oid {oid}", fixed("string"), lambda text, typmod: text, from_binary)


def binary_text(oid: int, raw: bytes, facts: Mapping[int, UserType], depth: int) -> str:
    """A binary value of type ``oid`` as PostgreSQL's output function prints it."""
    if depth > MAX_DEPTH:
        raise ValueConversionError(f"type OID {oid}: nested deeper than {MAX_DEPTH} levels (a domain or composite "
                                   "that contains itself?)")
    user = facts.get(oid)
    if user is None:
        builtin = lookup(oid)
        if builtin is None:
            raise ValueConversionError(f"type OID {oid} is neither built in nor in the captured catalog facts; "
                                       "its binary value cannot be read (use the publication in text mode)")
        return exact_text_type(builtin).from_binary(raw, -1)
    if user.kind == "domain":
        return binary_text(user.base, raw, facts, depth + 1)
    if user.kind == "enum":
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueConversionError(f"{user.name}: enum label is not valid UTF-8 at byte {exc.start}") from None
    if user.kind == "composite":
        return record_text(user.name, user.fields, raw, facts, depth)
    if user.kind == "array":
        return array_literal(decode_binary_array(raw, _element_type(user.base, facts, depth + 1), -1))
    # A user-defined base, range or multirange type (an extension's): read as before the facts were
    # kept, as text if its binary form is (citext's is), else an error asking for text mode.
    return custom_from_binary(raw, -1)


def record_text(type_name: str, fields: Sequence[tuple[str, int]] | None, raw: bytes,
                facts: Mapping[int, UserType], depth: int) -> str:
    """``record_send``'s layout -> ``record_out``'s text: Int32 field count, then per field its type
    OID, Int32 length (-1: NULL) and value; every field checked against the catalog's ``fields``, or,
    with none (a capture without facts), decoded by the type OID the wire names."""
    if len(raw) < 4:
        raise ValueConversionError(f"{type_name}: binary composite shorter than its field count")
    (count,) = _INT32.unpack_from(raw)
    if fields is None:
        if count < 0 or count > (len(raw) - 4) // _FIELD_HEADER.size:
            raise ValueConversionError(f"{type_name}: binary composite field count {count} out of range")
        fields = [(f"field {number}", -1) for number in range(1, count + 1)]
    if count != len(fields):
        raise ValueConversionError(f"{type_name}: binary composite has {count} fields, the catalog gives "
                                   f"{len(fields)}")
    pos = 4
    parts = []
    for name, expected_oid in fields:
        if pos + _FIELD_HEADER.size > len(raw):
            raise ValueConversionError(f"{type_name}.{name}: binary composite truncated at byte {pos}")
        field_oid, length = _FIELD_HEADER.unpack_from(raw, pos)
        if expected_oid != -1 and field_oid != expected_oid:
            raise ValueConversionError(f"{type_name}.{name}: binary field has type OID {field_oid}, the catalog "
                                       f"gives {expected_oid}")
        pos += _FIELD_HEADER.size
        if length == -1:
            parts.append("")
            continue
        if length < 0 or pos + length > len(raw):
            raise ValueConversionError(f"{type_name}.{name}: field length {length} at byte {pos - 4} runs past the "
                                       f"{len(raw)} bytes of the value")
        parts.append(_record_quoted(binary_text(field_oid, raw[pos:pos + length], facts, depth + 1)))
        pos += length
    if pos != len(raw):
        raise ValueConversionError(f"{type_name}: {len(raw) - pos} bytes after the last field of a binary composite")
    return "(" + ",".join(parts) + ")"


def _record_quoted(text: str) -> str:
    """record_out's quoting: empty, or holding a quote, backslash, parenthesis, comma or space."""
    if text == "" or any(c in text for c in '"\\(),' + " \t\n\r\v\f"):
        return '"' + text.replace("\\", "\\\\").replace('"', '""') + '"'
    return text


def wire_described_type(oid: int, qualified: str) -> PgType:
    """A type made at run time that a Type message names without the catalog's facts (a capture made
    by another tool, or before facts were kept). Its binary values are read as far as the wire
    describes them: an enum's value is its label; a composite's ``record_send`` names each field's
    type, so one of built-in fields decodes. A field of a user-defined type names only its OID: that
    needs the catalog, and the error names the OID and the remedy."""
    def from_binary(raw: bytes, typmod: int) -> str:
        if b"\x00" not in raw:
            return custom_from_binary(raw, typmod)  # an enum label
        try:
            return record_text(qualified, None, raw, {}, 0)
        except ValueConversionError as exc:
            raise ValueConversionError(
                f"{qualified}: a binary value that is neither an enum label nor a composite of built-in types "
                f"({exc}); without the catalog's facts about the type it cannot be read: capture with "
                "cdc-apply capture (which records them), or read the publication in text mode "
                "(source.binary: false)") from None

    return PgType(oid, qualified, fixed("string"), lambda text, typmod: text, from_binary)
