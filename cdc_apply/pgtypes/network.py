"""inet, cidr, macaddr, macaddr8, bit and varbit: all travel as PostgreSQL's text form."""

from __future__ import annotations

import ipaddress

from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed, register

PGSQL_AF_INET = 2
PGSQL_AF_INET6 = 3


def _text(text: str, typmod: int) -> str:
    return text


def _inet_binary(raw: bytes, typmod: int, cidr: bool) -> str:
    if len(raw) < 4:
        raise ValueConversionError("binary inet needs a 4-byte header")
    family, bits, is_cidr, size = raw[0], raw[1], raw[2], raw[3]
    expected = {PGSQL_AF_INET: 4, PGSQL_AF_INET6: 16}.get(family)
    if expected is None or size != expected or len(raw) != 4 + size or bits > 8 * size:
        raise ValueConversionError("malformed binary inet/cidr")
    address = ipaddress.ip_address(raw[4:])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        host = f"::ffff:{address.ipv4_mapped}"
    else:
        host = address.compressed
    full_length = bits == 8 * size
    return host if (full_length and not (cidr or is_cidr)) else f"{host}/{bits}"


def _mac_binary(size: int):  # type: ignore[no-untyped-def]
    def read(raw: bytes, typmod: int) -> str:
        if len(raw) != size:
            raise ValueConversionError(f"binary macaddr must be {size} bytes, got {len(raw)}")
        return ":".join(f"{b:02x}" for b in raw)

    return read


def _bits_binary(raw: bytes, typmod: int) -> str:
    if len(raw) < 4:
        raise ValueConversionError("binary bit string needs a 4-byte length")
    length = int.from_bytes(raw[:4], "big", signed=True)
    if length < 0 or len(raw) != 4 + (length + 7) // 8:
        raise ValueConversionError("malformed binary bit string")
    return "".join(f"{b:08b}" for b in raw[4:])[:length]


register(PgType(869, "inet", fixed("string"), _text, lambda raw, t: _inet_binary(raw, t, False), array_oid=1041))
register(PgType(650, "cidr", fixed("string"), _text, lambda raw, t: _inet_binary(raw, t, True), array_oid=651))
register(PgType(829, "macaddr", fixed("string"), _text, _mac_binary(6), array_oid=1040))
register(PgType(774, "macaddr8", fixed("string"), _text, _mac_binary(8), array_oid=775))
register(PgType(1560, "bit", fixed("string"), _text, _bits_binary, array_oid=1561))
register(PgType(1562, "varbit", fixed("string"), _text, _bits_binary, array_oid=1563))
