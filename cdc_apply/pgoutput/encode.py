"""Typed messages -> pgoutput bytes, for the messages cdc_apply carries along with its change rows."""

from __future__ import annotations

import struct

from cdc_apply.pgoutput import messages as m


def encode_relation(relation: m.Relation) -> bytes:
    """A Relation message (outside a stream block), the inverse of the decoder's ``_relation``."""
    parts = [b"R", struct.pack("!I", relation.oid), relation.namespace.encode() + b"\0", relation.name.encode() + b"\0",
             relation.replica_identity.encode(), struct.pack("!h", len(relation.columns))]
    for column in relation.columns:
        parts.append(struct.pack("!B", column.flags) + column.name.encode() + b"\0"
                     + struct.pack("!Ii", column.type_oid, column.typmod))
    return b"".join(parts)
