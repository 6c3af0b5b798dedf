"""Change rows compared value by value, with NaN equal to NaN (as the oracle renders it)."""

from __future__ import annotations

import math
from typing import Any

from cdc_apply.changerows.columns import NotArrowRepresentable


def normalised(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    return value


def assert_columnar_matches_scalar(segment: Any, label: str = "") -> None:
    """The column-at-a-time conversion equals the change-by-change one, row for row."""
    columnar, scalar = normalised(segment.rows), normalised(segment.scalar_rows())
    assert len(columnar) == len(scalar), label
    for got, want in zip(columnar, scalar, strict=True):
        assert got == want, f"{label}: columnar {got!r} != scalar {want!r}"
    try:
        table = segment.to_arrow()
    except NotArrowRepresentable as exc:
        assert "multi-dimensional" in str(exc), exc
        return
    assert table.schema == segment.schema(), label
    assert table.num_rows == len(scalar), label
