"""`cdc-apply demo` end to end, as the README's first command runs it."""

from __future__ import annotations

import re

import pytest

from tests.test_decode_cli import _cli


@pytest.mark.spark
@pytest.mark.pg
def test_demo_streams_the_workload_into_delta(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    warehouse = tmp_path / "wh"
    demo = _cli("demo", "--warehouse", str(warehouse))
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert demo.stdout.count("equal, value by value") == 2 and "DIFFERENT" not in demo.stdout
    assert "snapshot public.customers: 2 rows" in demo.stdout and "lag commit -> Delta" in demo.stdout
    # The first batch, which pays the JVM's first writes, apart; each step's time; a pointer to the benches.
    assert re.search(r"first batch \(a new JVM's first writes\): \d+ transaction", demo.stdout), demo.stdout[-2000:]
    assert re.search(r"the steps: 1/5 [\d.]+ s, 2/5 [\d.]+ s, 3/5 [\d.]+ s, 4/5 [\d.]+ s, 5/5 [\d.]+ s", demo.stdout)
    assert "cdc-apply bench e2e" in demo.stdout
    customers = spark.read.format("delta").load(str(warehouse / "public" / "customers"))
    rows = {r["id"]: r for r in customers.collect()}
    assert sorted(rows) == [1, 3]  # key 2 moved to 20, then 20 was deleted
    assert rows[3]["tier"] == "gold" and rows[1]["tier"] is None  # ADD COLUMN without a default
    assert rows[1]["email"] == "ada@lovelace.org" and len(rows[1]["notes"]) == 600 * 32  # TOAST kept
    orders = spark.read.format("delta").load(str(warehouse / "public" / "orders"))
    assert [r["id"] for r in orders.collect()] == [100]  # the truncate emptied it first
