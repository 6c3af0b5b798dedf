"""The full type matrix through Delta: what Spark reads back equals what was decoded (and the decoded
values equal PostgreSQL's, test_type_roundtrip.py), for text and binary captures."""

from __future__ import annotations

import math

import pytest
from pyspark.sql import functions as F

from cdc_apply.apply.batch import BatchApplier
from cdc_apply.apply.options import ApplyOptions, TableOptions
from cdc_apply.assemble import Assembler
from cdc_apply.errors import CdcApplyError
from tests.delta_oracle import _carried, _python
from tests.test_type_roundtrip import captured  # noqa: F401 - the module-scoped capture fixture


def _same(left: object, right: object) -> bool:
    if isinstance(left, float) and isinstance(right, float):
        if math.isnan(left):
            return math.isnan(right)
        return left == right and math.copysign(1, left) == math.copysign(1, right)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_same(left[k], right[k]) for k in left)
    return left == right


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
@pytest.mark.parametrize("batches", ["one", "columnar", "staged"])
def test_every_type_lands_in_delta_unchanged(captured, spark, tmp_path, binary, batches) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """``columnar``: the first rows create the target, then the other inserts are new rows only,
    appended straight from Arrow (apply/columnar.py) instead of through the collapse. ``staged``: the
    same, every frame staged as a Parquet file (apply/staging.py)."""
    columns, truth, decoded, captures, _ = captured
    two_dimensional = next(name for name, type_name in columns.items() if type_name == "int4[]")
    options = ApplyOptions(warehouse=str(tmp_path), defaults=TableOptions(columns_exclude=(two_dimensional,)),
                           staging_rows=1 if batches == "staged" else 0)
    applier = BatchApplier(spark, options)
    transactions = list(Assembler().transactions(captures[binary]))
    if batches == "one":
        assert not applier.apply(transactions).tables[0].columnar
    else:
        # Row 1 holds the 2-D array, which Arrow cannot hold even in an excluded column: the collapse takes it.
        assert not applier.apply(transactions[:2]).tables[0].columnar
        rest = applier.apply(transactions[2:]).tables[0]
        assert rest.columnar and rest.write == "append" and rest.keys_written == len(transactions) - 2
        staged = tmp_path / "_cdc_apply" / "staging" / "cdc_apply"
        assert (batches == "staged") == staged.is_dir() and not (staged.is_dir() and list(staged.iterdir()))
    frame = spark.read.format("delta").load(f"{tmp_path}/public/typed")
    fields = {f.name: f.dataType for f in frame.schema.fields}
    names = ["id", *(n for n in columns if n != two_dimensional)]
    assert two_dimensional not in fields and set(names) <= set(fields)
    rows = frame.select([_carried(F.col(n), fields[n]).alias(n) for n in names]).collect()
    assert len(rows) == len(decoded[binary])
    for row in rows:
        expected = decoded[binary][row["id"]]
        for name in names:
            got = _python(row[name])
            assert _same(expected[name], got), f"{columns.get(name, name)} row {row['id']}: {expected[name]!r} != {got!r}"


def test_a_multidimensional_array_fails_loudly_naming_the_column(captured, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    columns, truth, decoded, captures, _ = captured
    two_dimensional = next(name for name, type_name in columns.items() if type_name == "int4[]")
    with pytest.raises(CdcApplyError, match=f"column '{two_dimensional}': value \\[\\[1, 2\\], \\[3, 4\\]\\]"):
        BatchApplier(spark, ApplyOptions(warehouse=str(tmp_path))).apply(Assembler().transactions(captures[False]))
