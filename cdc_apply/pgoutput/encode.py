"""Typed messages -> pgoutput bytes, for the messages cdc_apply carries along with its change rows."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.pgoutput import messages as m


def encode_relation(relation: m.Relation) -> bytes:
    """A Relation message (outside a stream block), the inverse of the decoder's ``_relation``."""
    parts = [b"R", struct.pack("!I", relation.oid), relation.namespace.encode() + b"\0", relation.name.encode() + b"\0",
             relation.replica_identity.encode(), struct.pack("!h", len(relation.columns))]
    for column in relation.columns:
        parts.append(struct.pack("!B", column.flags) + column.name.encode() + b"\0"
                     + struct.pack("!Ii", column.type_oid, column.typmod))
    return b"".join(parts)


def encode_inserts(relation_oid: int, values: Sequence[pa.Array], rows: int) -> pa.Array:
    """One Insert message for each of ``rows`` rows (outside a stream block) of text-format ``values``,
    one array per column in the relation's order, SQL NULL as null: the message each row would have
    had, had it come from the slot. Built a column at a time by Arrow, not a row at a time."""
    header = b"I" + struct.pack("!I", relation_oid) + b"N" + struct.pack("!h", len(values))
    empty = pa.scalar(b"", pa.large_binary())
    parts = [pa.repeat(pa.scalar(header, pa.large_binary()), rows)]
    for column in values:
        column = column.cast(pa.large_binary())
        lengths = pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(">u4")
        prefix = np.empty((rows, 5), np.uint8)
        prefix[:, 0] = ord("t")
        prefix[:, 1:] = lengths.view(np.uint8).reshape(-1, 4)
        prefixes = pa.FixedSizeBinaryArray.from_buffers(pa.binary(5), rows, [None, pa.py_buffer(prefix)])
        text = pc.binary_join_element_wise(prefixes.cast(pa.large_binary()), column, empty)
        parts.append(pc.fill_null(text, pa.scalar(b"n", pa.large_binary())))  # a NULL: 'n', no length
    return pc.binary_join_element_wise(*parts, empty).cast(pa.binary())
