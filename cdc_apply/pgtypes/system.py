"""pg_lsn, xid8, cid and tid: system values a table may hold, as PostgreSQL's text of them; and the
built-in types with a binary send function that cdc_apply has no binary decoder for, refused by name.

Text mode reads every type (its text is the value); binary mode reads these from ``*_send``'s bytes.
"""

from __future__ import annotations

import struct

from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed, register


def _text(text: str, typmod: int) -> str:
    return text


def _exact(raw: bytes, size: int, name: str) -> bytes:
    if len(raw) != size:
        raise ValueConversionError(f"binary {name} must be {size} bytes, got {len(raw)}")
    return raw


def _pg_lsn_binary(raw: bytes, typmod: int) -> str:
    (lsn,) = struct.unpack("!Q", _exact(raw, 8, "pg_lsn"))
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _unsigned_binary(size: int, name: str):  # type: ignore[no-untyped-def]
    fmt = {4: "!I", 8: "!Q"}[size]

    def read(raw: bytes, typmod: int) -> str:
        return str(struct.unpack(fmt, _exact(raw, size, name))[0])

    return read


def _tid_binary(raw: bytes, typmod: int) -> str:
    block, offset = struct.unpack("!IH", _exact(raw, 6, "tid"))
    return f"({block},{offset})"


register(PgType(3220, "pg_lsn", fixed("string"), _text, _pg_lsn_binary, array_oid=3221))
register(PgType(5069, "xid8", fixed("string"), _text, _unsigned_binary(8, "xid8"), array_oid=271))
register(PgType(29, "cid", fixed("string"), _text, _unsigned_binary(4, "cid"), array_oid=1012))
register(PgType(27, "tid", fixed("string"), _text, _tid_binary, array_oid=1010))

# Built-in types with a binary send function whose binary form cdc_apply does not decode, and arrays
# of them: geometric types (float8out's formatting of each coordinate), text search and jsonpath
# (encodings of their own), reg* (an OID whose text is a catalog name), snapshots, the system
# catalogs' row types and catalog-internal types. A binary value of one is refused by name
# (``undecoded_builtin``); text mode reads them all as PostgreSQL's text. Read from ``pg_type`` of
# PostgreSQL 15 and 18; a test compares it with the live server's.
WITHOUT_BINARY_DECODER = {
    22: "int2vector", 24: "regproc", 30: "oidvector", 71: "pg_type", 75: "pg_attribute", 81: "pg_proc",
    83: "pg_class", 194: "pg_node_tree", 210: "_pg_type", 270: "_pg_attribute", 272: "_pg_proc", 273: "_pg_class",
    600: "point", 601: "lseg", 602: "path", 603: "box", 604: "polygon", 628: "line", 629: "_line", 718: "circle",
    719: "_circle", 1006: "_int2vector", 1008: "_regproc", 1013: "_oidvector", 1017: "_point", 1018: "_lseg",
    1019: "_path", 1020: "_box", 1027: "_polygon", 1034: "_aclitem", 1248: "pg_database", 1263: "_cstring",
    1790: "refcursor", 2201: "_refcursor", 2202: "regprocedure", 2203: "regoper", 2204: "regoperator",
    2205: "regclass", 2206: "regtype", 2207: "_regprocedure", 2208: "_regoper", 2209: "_regoperator",
    2210: "_regclass", 2211: "_regtype", 2842: "pg_authid", 2843: "pg_auth_members", 2949: "_txid_snapshot",
    2970: "txid_snapshot", 3361: "pg_ndistinct", 3402: "pg_dependencies", 3614: "tsvector", 3615: "tsquery",
    3643: "_tsvector", 3644: "_gtsvector", 3645: "_tsquery", 3734: "regconfig", 3735: "_regconfig",
    3769: "regdictionary", 3770: "_regdictionary", 4066: "pg_shseclabel", 4072: "jsonpath", 4073: "_jsonpath",
    4089: "regnamespace", 4090: "_regnamespace", 4096: "regrole", 4097: "_regrole", 4191: "regcollation",
    4192: "_regcollation", 4600: "pg_brin_bloom_summary", 4601: "pg_brin_minmax_multi_summary",
    5017: "pg_mcv_list", 5038: "pg_snapshot", 5039: "_pg_snapshot", 6101: "pg_subscription",
}


def undecoded_builtin(oid: int) -> PgType:
    """A built-in type without a decoder here: its text in text mode; a binary value an error naming
    the type and the remedy (the caller adds the column, the table and the LSN)."""
    name = WITHOUT_BINARY_DECODER.get(oid, f"OID {oid}")

    def refuse(raw: bytes, typmod: int) -> str:
        raise ValueConversionError(f"type {name} (OID {oid}) is built in, but cdc_apply has no decoder for its "
                                   "binary form: read the publication in text mode (source.binary: false)")

    return PgType(oid, name, fixed("string"), _text, refuse)
