"""Transactions larger than the spill budget (``batching.spill_bytes``): appended a piece at a time
in one Delta commit per table when they insert only (``apply/pieces.py``), through
the whole path otherwise; either way every target equals PostgreSQL, read by Spark and delta-rs,
and a crash between pieces leaves no part of the transaction visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_apply.apply.options import ApplyOptions, apply_options
from cdc_apply.assemble import Assembler
from cdc_apply.transactions import SpilledChanges
from cdc_apply.config import load_config
from cdc_apply.lsn import parse_lsn
from cdc_apply.replay import replay
from cdc_apply.sources.capture import read_captures, write_jsonl
from cdc_apply.sources.slot import PgOutputOptions, create_slot
from tests.capture_helpers import peek
from tests.conftest import fresh_database
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows

SPILL_BYTES = 64 * 1024  # every large transaction below spills: tens of spill chunks each
COLUMNS = {"public.big": ["id", "payload", "n", "ts", "extra"], "public.loose": ["v", "n"],
           "public.upd": ["id", "v"]}


@pytest.fixture(scope="module")
def workload(pg18, tmp_path_factory):  # type: ignore[no-untyped-def]
    for server, dbname in fresh_database(pg18):
        with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
            conn.execute("CREATE TABLE big (id bigint PRIMARY KEY, payload text, n numeric(12,2), ts timestamptz);"
                         "CREATE TABLE loose (v text, n int);"  # no key: insert-only
                         "CREATE TABLE upd (id int PRIMARY KEY, v text);"
                         "CREATE PUBLICATION p FOR TABLE big, loose, upd")
            create_slot(conn, "s")
            conn.execute("INSERT INTO big VALUES (0, 'first', 0, now()); INSERT INTO loose VALUES ('first', 0);"
                         "INSERT INTO upd SELECT g, 'a' FROM generate_series(1, 100) g")
            with conn.transaction():  # inserts only, two tables, a rolled-back savepoint: in pieces
                conn.execute("INSERT INTO big SELECT g, repeat('x', 200) || g, g / 7.0, now() "
                             "FROM generate_series(1, 3000) g")
                with conn.transaction():
                    conn.execute("INSERT INTO big SELECT g, 'rolled back', 0, now() FROM generate_series(5001, 6000) g")
                    raise psycopg.Rollback()
                conn.execute("INSERT INTO loose SELECT 'v' || g || repeat('-', 100), g FROM generate_series(1, 2000) g")
                conn.execute("INSERT INTO loose SELECT 'same', 1 FROM generate_series(1, 500) g")  # identical rows
                conn.execute("INSERT INTO big SELECT g, repeat('y', 100), NULL, NULL FROM generate_series(3001, 4000) g")
            pieced_lsn = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
            conn.execute("INSERT INTO big VALUES (-1, 'small', 1, now())")
            with conn.transaction():  # updates: the whole path
                conn.execute("UPDATE upd SET v = repeat('u', 300) WHERE id <= 100")
                conn.execute("INSERT INTO upd SELECT g, repeat('i', 300) FROM generate_series(101, 1100) g")
            with conn.transaction():  # inserts across a schema change: the whole path
                conn.execute("INSERT INTO big SELECT g, repeat('z', 300), 1, now() FROM generate_series(10001, 11000) g")
                conn.execute("ALTER TABLE big ADD COLUMN extra int")
                conn.execute("INSERT INTO big SELECT g, repeat('w', 300), 2, now(), g FROM generate_series(11001, 12000) g")
            truth = {name: postgres_rows(conn, name, columns) for name, columns in COLUMNS.items()}
            types = {name: source_types(conn, name) for name in COLUMNS}
        capture = tmp_path_factory.mktemp("large") / "large.jsonl"
        write_jsonl(capture, peek(server, dbname, "s", PgOutputOptions(("p",), 2, streaming="on")))
        yield str(capture), truth, types, pieced_lsn


def _history(spark, path: str) -> list:  # type: ignore[no-untyped-def,type-arg]
    return spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()


def test_spilled_changes_are_counted_and_read_back_in_pieces(workload) -> None:  # type: ignore[no-untyped-def]
    capture, _, _, _ = workload
    raws = list(read_captures([capture]))
    whole = [t for t in Assembler().transactions(raws)]
    spilled = [t for t in Assembler(spill_bytes=SPILL_BYTES).transactions(raws)]
    large = [t for t in spilled if isinstance(t.changes, SpilledChanges)]
    assert len(large) == 3 and not any(isinstance(t.changes, SpilledChanges) for t in whole)
    for txn, same in zip(spilled, whole, strict=True):
        if not isinstance(txn.changes, SpilledChanges):
            continue
        assert len(txn.changes) == len(same.changes)  # counted as they arrived, not read back
        assert txn.relation_oids() == same.relation_oids()
        assert txn.changes.ops == {c.op for c in same.changes}
        pieces = list(txn.changes.pieces(8 * 1024))
        assert len(pieces) > 10 and all(sum(len(c.wire or b"") for c in p) <= 8 * 1024 for p in pieces if len(p) > 1)
        assert [c.wire for p in pieces for c in p] == [c.wire for c in same.changes]  # the rollback left out
        assert [c.seq for c in txn.changes] == [c.seq for c in same.changes]  # read back whole, as a list would


def test_inserts_are_appended_in_pieces_in_one_commit_and_the_rest_takes_the_whole_path(  # type: ignore[no-untyped-def]
        workload, spark, tmp_path):
    capture, truth, types, pieced_lsn = workload
    warehouse = str(tmp_path / "wh")
    options = ApplyOptions(warehouse=warehouse, piece_bytes=SPILL_BYTES)
    results = replay(spark, [capture], options, spill_bytes=SPILL_BYTES)
    tables = [table for batch in results for table in batch.tables]
    pieced = {t.table: t for t in tables if t.pieces}
    assert set(pieced) == {"public.big", "public.loose"}
    assert pieced["public.big"].ops == {"I": 4000} and pieced["public.loose"].ops == {"I": 2500}
    assert {name: (t.pieces > 3, t.write) for name, t in pieced.items()} == \
        {name: (True, "append") for name in pieced}, {name: t.pieces for name, t in pieced.items()}
    # The update transaction and the one with a schema change went through the whole path.
    assert any(t.table == "public.upd" and t.ops == {"U": 100, "I": 1000} and not t.pieces for t in tables)
    assert any(t.table == "public.big" and t.ops == {"I": 2000} and not t.pieces for t in tables)
    for name, columns in COLUMNS.items():
        assert delta_rows(spark, f"{warehouse}/{name.replace('.', '/')}", columns, types[name]) == truth[name], name
    # The pieced transaction is one commit of each table, which says what all its pieces wrote.
    for name, rows in (("big", 4000), ("loose", 2500)):
        commits = [h for h in _history(spark, f"{warehouse}/public/{name}")
                   if h.userMetadata and json.loads(h.userMetadata).get("ops") == ({"I": rows})]
        assert len(commits) == 1, name
        assert commits[0].operationMetrics["numOutputRows"] == str(rows)
        assert int(commits[0].operationMetrics["numFiles"]) >= 2
        assert parse_lsn(json.loads(commits[0].userMetadata)["last_lsn"]) < parse_lsn(str(pieced_lsn))
    # Replayed again: every table holds every transaction already.
    versions = {name: len(_history(spark, f"{warehouse}/public/{name}")) for name in ("big", "loose", "upd")}
    again = replay(spark, [capture], options, spill_bytes=SPILL_BYTES)
    assert all(t.skipped for batch in again for t in batch.tables)
    assert {name: len(_history(spark, f"{warehouse}/public/{name}")) for name in versions} == versions


@pytest.mark.crash
def test_a_crash_between_pieces_leaves_no_part_of_the_transaction(workload, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    capture, truth, types, _ = workload
    warehouse = tmp_path / "wh"
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"target": {"warehouse": str(warehouse)},
                                  "batching": {"spill_bytes": SPILL_BYTES, "max_changes": 1}}))
    command = [sys.executable, "-m", "cdc_apply.cli", "replay", capture, "--config", str(config)]
    killed = subprocess.run(command, env={**os.environ, "CDC_APPLY_FAILPOINT": "between_pieces:3"},
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    big = str(warehouse / "public" / "big")
    # The first transactions are committed; of the pieced one nothing is visible, though files were written.
    assert sorted(r.id for r in spark.read.format("delta").load(big).collect()) == [0]
    by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(big).scan(columns=["id"])).read_all()
    assert by_delta_rs.column("id").to_pylist() == [0]  # the second reader sees no piece either
    written = {p.name for p in Path(big).glob("*.parquet")}
    in_table = {Path(f).name for f in spark.read.format("delta").load(big).inputFiles()}
    assert written - in_table, "the pieces before the crash wrote files that no commit names"
    # The restart, in this process (a second Spark start costs 20 s): the same config, the same pipeline.
    options = apply_options(load_config(str(config)))
    assert options.piece_bytes == SPILL_BYTES
    replay(spark, [capture], options, spill_bytes=SPILL_BYTES, max_changes=1)
    for name, columns in COLUMNS.items():
        assert delta_rows(spark, str(warehouse / name.replace(".", "/")), columns, types[name]) == truth[name], name
