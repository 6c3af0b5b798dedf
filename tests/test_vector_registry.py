"""One converter registry: each type's vector converters are registered with its scalar ones
(pgtypes/registry.py), and give what the scalar ones give for PostgreSQL's ordinary output."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cdc_apply.pgtypes import lookup, registered
from cdc_apply.pgtypes.vectorized import convert_text
from cdc_apply.pgtypes.sparktypes import arrow_type

SAMPLES = {
    16: ["t", "f"], 21: ["-32768", "7"], 23: ["2147483647", "-1"], 20: ["-9223372036854775808", "42"],
    26: ["4294967295", "0"], 28: ["3", "17"], 700: ["1.5", "-0", "NaN"], 701: ["1e+300", "-Infinity", "0.1"],
    1700: ["12.50", "-0.01"], 25: ["héllo", ""], 1043: ["a b"], 1042: ["x  "], 19: ["pg_class"], 18: ["c"],
    114: ['{"a": 1}'], 1082: ["2024-02-29", "1970-01-01"], 1114: ["2024-02-29 12:34:56.789012"],
    1184: ["2024-02-29 12:34:56.789012+00"],
}
TYPMOD = {1700: ((10 << 16) | 2) + 4}  # numeric(10,2)


def test_the_vector_converters_are_the_ones_registered_under_each_oid() -> None:
    with_vectors = {t.oid for t in registered() if t.vector_text is not None}
    assert with_vectors == set(SAMPLES)
    assert {t.oid for t in registered() if t.vector_binary is not None} == set(SAMPLES)


@pytest.mark.parametrize("oid", sorted(SAMPLES))
def test_a_vector_converter_gives_what_the_scalar_one_gives(oid: int) -> None:
    pg_type = lookup(oid)
    assert pg_type is not None
    typmod = TYPMOD.get(oid, -1)
    arrow = arrow_type(pg_type.spark_type(typmod))
    texts = SAMPLES[oid] + [None]
    vector = convert_text(pg_type, pa.array(texts, pa.large_string()), arrow)
    scalar = pa.array([None if t is None else pg_type.from_text(t, typmod) for t in texts], arrow)
    assert vector.type == arrow
    # repr: NaN equals NaN, and -0.0 stays apart from 0.0
    assert [repr(v) for v in vector.to_pylist()] == [repr(v) for v in scalar.to_pylist()]
