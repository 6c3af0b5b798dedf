"""Oracle tests: a workload on a real PostgreSQL, captured, replayed into Delta, compared value by value."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from cdc_apply.apply.options import ApplyOptions
from cdc_apply.replay import replay
from cdc_apply.sources.capture import write_jsonl
from tests.capture_helpers import peek
from tests.conftest import fresh_database
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from tests.workloads import TABLES, run_golden_workload, variants


@pytest.fixture(scope="module")
def golden18(pg18):  # type: ignore[no-untyped-def]
    for server, dbname in fresh_database(pg18):
        found = {v.name: v for v in variants(180000)}
        chosen = [found["v2-stream"], found["v3-twophase"]]
        run_golden_workload(server, dbname, {v.slot: v.two_phase_slot for v in chosen})
        captures = {(v.name, binary): peek(server, dbname, v.slot, dataclasses.replace(v.options, binary=binary))
                    for v in chosen for binary in (False, True)}
        with psycopg.connect(server.conninfo(dbname)) as conn:
            truth = {name: postgres_rows(conn, name, cols) for name, cols in TABLES.items()}
            types = {name: source_types(conn, name) for name in TABLES}
        yield captures, truth, types


def _assert_equal(spark, warehouse, truth, types, label):  # type: ignore[no-untyped-def]
    for name, columns in TABLES.items():
        schema, _, table = name.partition(".")
        got = delta_rows(spark, f"{warehouse}/{schema}/{table}", columns, types[name])
        assert got == truth[name], f"{label}: {name}"


@pytest.mark.parametrize("variant", ["v2-stream", "v3-twophase"])
@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_golden_workload_lands_in_delta_equal_to_postgres(golden18, spark, tmp_path, variant, binary):  # type: ignore[no-untyped-def]
    captures, truth, types = golden18
    capture = tmp_path / "capture.jsonl"
    write_jsonl(capture, captures[(variant, binary)])
    results = replay(spark, [str(capture)], ApplyOptions(warehouse=str(tmp_path / "wh")))
    assert sum(b.changes for b in results) > 5000
    _assert_equal(spark, tmp_path / "wh", truth, types, f"{variant} binary={binary}")


def test_replay_is_idempotent_and_batch_splits_do_not_matter(golden18, spark, tmp_path):  # type: ignore[no-untyped-def]
    captures, truth, types = golden18
    capture = tmp_path / "capture.jsonl"
    write_jsonl(capture, captures[("v2-stream", False)])
    options = ApplyOptions(warehouse=str(tmp_path / "wh"))
    # Batches of up to 100 changes: the small transactions share batches cut between them, the large
    # ones (streamed, prepared) each have one. One transaction per batch is the text/root oracle's
    # (test_apply_semantics.py): each batch costs a MERGE per table, about 1.6 s.
    results = replay(spark, [str(capture)], options, max_changes=100)
    assert len(results) >= 4, len(results)
    _assert_equal(spark, tmp_path / "wh", truth, types, "batches of up to 100 changes")
    versions = {name: spark.sql(f"DESCRIBE HISTORY delta.`{tmp_path}/wh/{name.replace('.', '/')}`").count()
                for name in TABLES}
    again = replay(spark, [str(capture)], options)
    assert all(t.skipped for b in again for t in b.tables) and again
    after = {name: spark.sql(f"DESCRIBE HISTORY delta.`{tmp_path}/wh/{name.replace('.', '/')}`").count()
             for name in TABLES}
    assert after == versions
    _assert_equal(spark, tmp_path / "wh", truth, types, "replayed twice")
