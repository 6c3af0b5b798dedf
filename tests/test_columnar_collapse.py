"""The collapse as columns (apply/columnar.py) against the row-by-row collapse (apply/collapse.py),
on random change streams that follow PostgreSQL's rules: inserts of absent keys, updates (some
moving the row to another key, some sending a column as unchanged TOAST), deletes; with and without
full old images. Where the columnar collapse takes a batch, its MERGE source must say exactly what
the row-by-row collapse's states say. The Delta side of both paths: tests/test_apply_semantics.py."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from cdc_apply.apply.collapse import Collapser
from cdc_apply.apply.columnar import collapsed_columns
from cdc_apply.apply.options import COMMIT_LSN, KEEP, OP
from cdc_apply.changerows.columns import python_rows

DATA_TYPES = {"id": "bigint", "v": "int", "big": "string"}
IMAGE = pa.struct([("id", pa.int64()), ("v", pa.int32()), ("big", pa.string())])
SCHEMA = pa.schema([("commit_lsn", pa.int64()), ("commit_ts", pa.timestamp("us", tz="UTC")), ("xid", pa.int64()),
                    ("seq", pa.int32()), ("op", pa.string()), ("key", pa.struct([("id", pa.int64())])),
                    ("old", IMAGE), ("new", IMAGE), ("unchanged", pa.list_(pa.string())),
                    ("truncate_options", pa.int8())])


def _stream(rng: random.Random, changes: int, full_old: bool, key_changes: bool, toast: bool,
            initial: range) -> list[dict[str, Any]]:
    live: dict[int, dict[str, Any]] = {k: {"id": k, "v": k, "big": f"b{k}"} for k in initial}  # in the target
    rows = []
    for n in range(changes):
        base = {"commit_lsn": 1000 + n // 3, "commit_ts": n, "xid": n // 3, "seq": n % 3, "truncate_options": None,
                "old": None, "unchanged": [], "key": None, "new": None}
        roll = rng.random()
        absent = [k for k in range(1, 15) if k not in live]
        if roll < 0.25 and absent or not live:
            key = rng.choice(absent)
            live[key] = {"id": key, "v": rng.randint(0, 9), "big": f"i{n}"}
            rows.append(base | {"op": "I", "new": dict(live[key])})
            continue
        key = rng.choice(sorted(live))
        before = dict(live[key])
        if roll < 0.4:
            del live[key]
            rows.append(base | {"op": "D", "key": {"id": key}, "old": before if full_old else None})
            continue
        new_key = rng.choice(absent) if key_changes and absent and rng.random() < 0.3 else key
        after = {"id": new_key, "v": rng.randint(0, 9), "big": before["big"] if toast and rng.random() < 0.5
                 else f"u{n}"}
        del live[key]
        live[new_key] = after
        unchanged = after["big"] == before["big"]
        rows.append(base | {"op": "U", "key": {"id": key}, "old": before if full_old else None,
                            "new": after | ({"big": None} if unchanged else {}),
                            "unchanged": ["big"] if unchanged else []})
    return rows


def _row_by_row(table: pa.Table) -> dict[tuple[Any, ...], tuple[str, dict[str, Any], frozenset[str], int]]:
    collapser = Collapser("public.t", ("id",))
    for row in python_rows(table):
        collapser.add(row)
    result = {}
    for key, state in collapser.result.states.items():
        values = {} if state.deleted else {n: state.values.get(n) for n in DATA_TYPES if n not in state.from_target}
        kept = frozenset() if state.deleted else frozenset(state.from_target) | {
            n for n in DATA_TYPES if n not in state.values}
        result[key] = ("D" if state.deleted else "U", values, kept, state.commit_lsn)
    return result


def _as_columns(table: pa.Table) -> dict[tuple[Any, ...], tuple[str, dict[str, Any], frozenset[str], int]] | None:
    columnar = collapsed_columns(table, None, {n: n for n in DATA_TYPES}, ("id",), DATA_TYPES)
    if columnar is None:
        return None
    rows = pa.table(columnar.columns).to_pylist()
    assert len(rows) == columnar.keys_written
    result = {}
    for row in rows:
        kept = frozenset(row[KEEP] or ())
        values = {} if row[OP] == "D" else {n: row[n] for n in DATA_TYPES if n not in kept}
        result[(row["id"],)] = (row[OP], values, kept, row[COMMIT_LSN])
    assert len(result) == len(rows), "one row per key"
    return result


@pytest.mark.parametrize("full_old", [False, True], ids=["key-image", "full-old"])
def test_the_columnar_collapse_says_what_the_row_by_row_collapse_says(full_old: bool) -> None:
    rng = random.Random(5)
    taken = {"plain": 0, "key_changes": 0, "toast": 0}
    appended = 0
    for case in range(300):
        key_changes, toast = case % 3 == 1, case % 3 == 2
        initial = range(1, 8) if case % 2 else range(0)  # keys in the target at the start
        stream = _stream(rng, rng.randint(1, 30), full_old, key_changes, toast, initial)
        table = pa.Table.from_pylist(stream, schema=SCHEMA)
        got = _as_columns(table)
        if got is None:
            continue
        assert got == _row_by_row(table), f"case {case}: {stream}"
        # An append is right only when every key was absent at the start.
        new_rows_only = collapsed_columns(table, None, {n: n for n in DATA_TYPES}, ("id",), DATA_TYPES).new_rows_only  # type: ignore[union-attr]
        assert not new_rows_only or all(key[0] not in initial for key in got), f"case {case}: {stream}"
        collapser = Collapser("public.t", ("id",))
        for row in python_rows(table):
            collapser.add(row)
        assert new_rows_only or not collapser.result.new_rows_only, f"case {case}: {stream}"
        appended += new_rows_only
        taken["key_changes" if key_changes else "toast" if toast else "plain"] += 1
    # The columnar collapse must take most batches, key changes and unchanged TOAST included (a value
    # that an earlier change of the key holds is carried forward; the generator never moves a row
    # with an unchanged TOAST value).
    assert taken["plain"] == 100 and taken["toast"] == 100, taken
    assert taken["key_changes"] > 50, taken
    assert appended > 10


def _change(lsn: int, op: str, key: int, new: dict[str, Any] | None, unchanged: tuple[str, ...] = (),
            old_key: int | None = None) -> dict[str, Any]:
    return {"commit_lsn": lsn, "commit_ts": lsn, "xid": lsn, "seq": 0, "op": op,
            "key": None if op == "I" else {"id": key if old_key is None else old_key}, "old": None,
            "new": None if new is None else {"id": key, **new, **{name: None for name in unchanged}},
            "unchanged": list(unchanged), "truncate_options": None}


def test_a_value_an_earlier_change_of_the_key_holds_is_carried_forward_as_columns() -> None:
    """``big`` sent as unchanged TOAST after a change of the same key in the batch set it: the
    columnar collapse takes the value from that change, as the row-by-row collapse does."""
    cases = {
        "an update set it": [_change(1, "U", 1, {"v": 1, "big": "set"}), _change(2, "U", 1, {"v": 2}, ("big",))],
        "an insert after a delete set it": [_change(1, "D", 1, None), _change(2, "I", 1, {"v": 1, "big": "again"}),
                                            _change(3, "U", 1, {"v": 2}, ("big",)), _change(4, "U", 1, {"v": 3}, ("big",))],
        "nothing in the batch set it": [_change(1, "U", 1, {"v": 1}, ("big",)), _change(2, "U", 1, {"v": 2}, ("big",))],
    }
    for label, stream in cases.items():
        table = pa.Table.from_pylist(stream, schema=SCHEMA)
        assert _as_columns(table) == _row_by_row(table), label
    assert _row_by_row(pa.Table.from_pylist(cases["an update set it"], schema=SCHEMA))[(1,)] == \
        ("U", {"id": 1, "v": 2, "big": "set"}, frozenset(), 2)
    assert _as_columns(pa.Table.from_pylist(cases["nothing in the batch set it"], schema=SCHEMA))[(1,)][2] == \
        frozenset({"big"})  # the target's value stays


def test_a_value_from_another_keys_row_takes_the_row_by_row_collapse() -> None:
    """The row moved to key 2 from key 1 with ``big`` unchanged, then key 2 is updated again: the
    value is key 1's target row, which only the row-by-row collapse (reading the target) carries."""
    stream = [_change(1, "U", 2, {"v": 1}, ("big",), old_key=1), _change(2, "U", 2, {"v": 2}, ("big",))]
    assert _as_columns(pa.Table.from_pylist(stream, schema=SCHEMA)) is None


def test_changes_at_or_before_the_applied_lsn_are_left_out() -> None:
    """``after_lsn`` (the target's applied position) drops the changes it covers, and only those: the
    result equals the collapse of the later rows alone, whether it cuts the batch or lies before it."""
    rng = random.Random(9)
    cut_inside = 0
    for case in range(60):
        table = pa.Table.from_pylist(_stream(rng, rng.randint(1, 30), True, case % 2 == 1, False, range(0)),
                                     schema=SCHEMA)
        lsns = table["commit_lsn"].to_pylist()
        after = rng.randint(lsns[0] - 2, lsns[-1] + 1)
        later = table.filter(pc.greater(table["commit_lsn"], after))
        got = collapsed_columns(table, after, {n: n for n in DATA_TYPES}, ("id",), DATA_TYPES)
        want = collapsed_columns(later, None, {n: n for n in DATA_TYPES}, ("id",), DATA_TYPES)
        assert (got is None) == (want is None), f"case {case}"
        if got is not None and want is not None:
            assert pa.table(got.columns).equals(pa.table(want.columns)), f"case {case}, after {after}"
            assert (got.first_lsn, got.last_lsn, got.op_counts) == (want.first_lsn, want.last_lsn, want.op_counts)
            assert got.first_lsn > after
        cut_inside += lsns[0] <= after < lsns[-1]
    assert cut_inside > 10
