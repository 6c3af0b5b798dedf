"""All-null columns ship to Spark Connect at their size: its local relation goes in 1,024-row
slices, and ``pa.nulls`` of a list or map type is written whole in each (cdc_apply/arrow_nulls.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cdc_apply.arrow_nulls import null_array

ROWS = 100_000
KINDS = [pa.int64(), pa.string(), pa.list_(pa.string()), pa.large_list(pa.int32()), pa.map_(pa.string(), pa.string()),
         pa.struct([("a", pa.int32()), ("b", pa.map_(pa.string(), pa.string()))]),
         pa.list_(pa.map_(pa.string(), pa.int64()))]


def _sliced_ipc_bytes(array: pa.Array) -> int:
    """What Spark Connect's client sends of ``array``: an IPC stream per 1,024-row slice."""
    table = pa.table({"column": array})
    total = 0
    for batch in table.to_batches(max_chunksize=1024):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_batch(batch)
        total += sink.getvalue().size
    return total


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_null_columns_equal_arrows_own_and_slice_at_their_size(kind: pa.DataType) -> None:
    nulls = null_array(ROWS, kind)
    nulls.validate(full=True)
    assert nulls.type == kind and nulls.null_count == ROWS and nulls.equals(pa.array([None] * ROWS, kind))
    assert _sliced_ipc_bytes(nulls) < 30 * ROWS  # about 9 bytes a row: validity, offsets, each slice's header
    assert len(null_array(0, kind)) == 0


def test_arrows_own_null_map_grows_with_every_slice() -> None:
    """The reason for the module: should pyarrow fix this, ``null_array`` can become ``pa.nulls``."""
    kind = pa.map_(pa.string(), pa.string())
    assert _sliced_ipc_bytes(pa.nulls(ROWS, kind)) > 50 * _sliced_ipc_bytes(null_array(ROWS, kind))
