"""All-null Arrow columns that travel to Spark as small as they are.

``pa.nulls`` of a list or map type gives every row the same offsets buffer, and Arrow's IPC writer
writes that buffer whole for each slice of the array. Spark Connect sends a local relation in
slices of 1,024 rows, so such a column grows by the number of slices: a 969,000-row MERGE source
with an all-null ``_cdc_keep`` became 3.6 GB instead of 4 MB, past Connect's 3 GB limit
(``LOCAL_RELATION_SIZE_LIMIT_EXCEEDED``; found by `bench apply --connect`). Built from zero offsets,
a null list or map slices as any other column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def null_array(rows: int, kind: pa.DataType) -> pa.Array:
    """``rows`` nulls of ``kind``."""
    if not pa.types.is_nested(kind):
        return pa.nulls(rows, kind)
    mask = pa.array(np.ones(rows, np.bool_))
    if pa.types.is_map(kind):
        return pa.MapArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), null_array(0, kind.key_type),
                                       null_array(0, kind.item_type), type=kind, mask=mask)
    if pa.types.is_list(kind):
        return pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), null_array(0, kind.value_type),
                                        type=kind, mask=mask)
    if pa.types.is_large_list(kind):
        return pa.LargeListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int64)), null_array(0, kind.value_type),
                                             type=kind, mask=mask)
    if pa.types.is_struct(kind):
        return pa.StructArray.from_arrays([null_array(rows, field.type) for field in kind], fields=list(kind),
                                          mask=mask)
    return pa.array([None] * rows, kind)  # other nested types: slower to build, small in slices
