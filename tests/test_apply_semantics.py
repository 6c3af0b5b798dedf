"""Oracle tests for the apply semantics: identities, TOAST, key changes, truncate, schema evolution,
table rename, partitions (root on and off), delete modes and schema policies."""

from __future__ import annotations

import io

import psycopg
import pytest

from cdc_apply.apply.batch import BatchApplier
from cdc_apply.lake.state import TargetOwnedError
from cdc_apply.apply.options import ApplyOptions, TableOptions
from cdc_apply.assemble import Assembler
from cdc_apply.apply.schema import SchemaPolicyError
from cdc_apply.replay import print_summary, replay
from cdc_apply.sources.capture import read_captures, write_jsonl
from cdc_apply.sources.slot import PgOutputOptions, create_slot
from tests.apply_workloads import LEAF_TABLES, ROOT_TABLES, run_apply_workload
from tests.capture_helpers import peek
from tests.conftest import fresh_database
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows

EVOLVE = {"public.evolv*": TableOptions(schema_policy="evolve")}


@pytest.fixture(scope="module")
def workload(pg18, tmp_path_factory):  # type: ignore[no-untyped-def]
    for server, dbname in fresh_database(pg18):
        run_apply_workload(server, dbname)
        folder = tmp_path_factory.mktemp("captures")
        captures = {}
        for slot, publication in (("s_root", "pub_root"), ("s_leaf", "pub_leaf")):
            for binary in (False, True):
                raws = peek(server, dbname, slot, PgOutputOptions((publication,), 2, streaming="on", binary=binary))
                path = folder / f"{slot}-{binary}.jsonl"
                write_jsonl(path, raws)
                captures[(slot, binary)] = str(path)
        with psycopg.connect(server.conninfo(dbname)) as conn:
            names = set(ROOT_TABLES) | set(LEAF_TABLES)
            truth = {name: postgres_rows(conn, name, (ROOT_TABLES | LEAF_TABLES)[name][1]) for name in names}
            types = {name: source_types(conn, name) for name in names}
        yield captures, truth, types


def _compare(spark, warehouse, tables, truth, types):  # type: ignore[no-untyped-def]
    for name, (path, columns) in tables.items():
        got = delta_rows(spark, f"{warehouse}/{path}", columns, types[name])
        assert got == truth[name], name


@pytest.mark.parametrize("slot,tables", [("s_root", ROOT_TABLES), ("s_leaf", LEAF_TABLES)], ids=["root", "leaf"])
@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_every_table_equals_postgres(workload, spark, tmp_path, slot, tables, binary):  # type: ignore[no-untyped-def]
    """The capture replayed as one batch; the text capture of the root tables one transaction per
    batch instead (each of its schema changes then in a batch of its own): the same tables. The
    other three replay the whole capture at once, so both splits are checked in text and binary."""
    captures, truth, types = workload
    warehouse = str(tmp_path / "wh")
    per_transaction = slot == "s_root" and not binary
    results = replay(spark, [captures[(slot, binary)]], ApplyOptions(warehouse=warehouse, tables=EVOLVE),
                     max_changes=1 if per_transaction else 1_000_000)
    if per_transaction:
        assert len(results) > 30
    _compare(spark, warehouse, tables, truth, types)


def test_lenient_policy_keeps_dropped_and_renamed_columns(workload, spark, tmp_path):  # type: ignore[no-untyped-def]
    captures, truth, types = workload
    warehouse = str(tmp_path / "wh")
    results = replay(spark, [captures[("s_root", False)]], ApplyOptions(warehouse=warehouse))
    summary = io.StringIO()
    print_summary(results, summary)
    assert "source columns written to other target columns: e -> e__string" in summary.getvalue()
    history = spark.sql(f"DESCRIBE HISTORY delta.`{warehouse}/public/evolving`").collect()
    assert any('"side_columns": {"e": "e__string"}' in (h.userMetadata or "") for h in history)
    frame = spark.read.format("delta").load(f"{warehouse}/public/evolving")
    columns = [f.name for f in frame.schema.fields]
    assert columns[:5] == ["id", "a", "b", "c", "d"] and {"b2", "e", "e__string"} <= set(columns)
    assert dict(frame.schema.simpleString() and [(f.name, f.dataType.simpleString()) for f in frame.schema.fields])[
        "a"] == "bigint"
    rows = {r["id"]: r for r in frame.collect()}
    assert rows[1]["c"] == "c1" and rows[7]["c"] == "c7"  # the dropped column keeps its values
    assert rows[2]["b2"] == "renamed" and rows[2]["b"] == "b2"  # old column kept, new one added
    assert rows[5]["e__string"] == "text now" and rows[5]["e"] is None
    assert rows[8]["e__string"] == "eight" and 6 not in rows


def test_fail_policy_stops_with_the_place_and_keeps_earlier_commits(workload, spark, tmp_path):  # type: ignore[no-untyped-def]
    captures, truth, types = workload
    warehouse = str(tmp_path / "wh")
    options = ApplyOptions(warehouse=warehouse, tables={"public.evolv*": TableOptions(schema_policy="fail")})
    with pytest.raises(SchemaPolicyError, match=r"public\.evolving at LSN [0-9A-F]+/[0-9A-F]+: .*dropped column 'c'"):
        replay(spark, [captures[("s_root", False)]], options, max_changes=1)
    rows = {r["id"]: r for r in spark.read.format("delta").load(f"{warehouse}/public/evolving").collect()}
    assert rows[7]["e"] == 700 and rows[1]["c"] == "c1"  # committed before the refused change


def test_soft_deletes_keep_rows_marked(workload, spark, tmp_path):  # type: ignore[no-untyped-def]
    captures, truth, types = workload
    warehouse = str(tmp_path / "wh")
    options = ApplyOptions(warehouse=warehouse, tables=EVOLVE, defaults=TableOptions(delete_mode="soft"))
    replay(spark, [captures[("s_root", True)]], options, max_changes=50)  # rows exist before they go
    for name in ("public.ident_default", "public.docs", "public.ident_full", "public.measures"):
        path, columns = ROOT_TABLES[name]
        live = delta_rows(spark, f"{warehouse}/{path}", columns, types[name], where="NOT _cdc_deleted")
        assert live == truth[name], name
    deleted = spark.read.format("delta").load(f"{warehouse}/public/ident_default").where("_cdc_deleted")
    assert deleted.where("id = 7").count() == 1  # deleted
    assert deleted.where("id = 2").count() == 1  # truncated
    assert deleted.where("id = 1").count() == 0  # truncated, then inserted again


def test_scd2_history_keeps_every_version_and_one_current_row(workload, spark, tmp_path):  # type: ignore[no-untyped-def]
    captures, truth, types = workload
    warehouse = str(tmp_path / "wh")
    history = TableOptions(scd_type=2)
    options = ApplyOptions(warehouse=warehouse, tables={
        "public.evolv*": TableOptions(scd_type=2, schema_policy="evolve"), "public.ident_nothing": TableOptions(),
        "public.*": history})
    replay(spark, [captures[("s_root", False)]], options, max_changes=50)  # versions span batches
    for name in ("public.ident_default", "public.ident_index", "public.ident_full", "public.docs",
                 "public.evolved", "public.measures"):
        path, columns = ROOT_TABLES[name]
        current = delta_rows(spark, f"{warehouse}/{path}", columns, types[name], where="_cdc_current")
        assert current == truth[name], name
    docs = spark.read.format("delta").load(f"{warehouse}/public/docs")
    assert docs.groupBy("id").agg({"_cdc_current": "count"}).count() >= 4
    assert docs.where("_cdc_current").groupBy("id").count().where("count > 1").count() == 0
    ten = docs.where("id = 10").orderBy("_cdc_valid_from").collect()
    assert [r["title"] for r in ten] == ["one", "ten"] and ten[0]["_cdc_valid_to"] == ten[1]["_cdc_valid_from"]
    assert all(len(r["body"]) > 8000 for r in ten)  # unchanged TOAST carried into every version
    one = docs.where("id = 1").orderBy("_cdc_valid_from").collect()
    assert one and not one[-1]["_cdc_current"] and one[-1]["_cdc_valid_to"] is not None  # key moved away
    default = spark.read.format("delta").load(f"{warehouse}/public/ident_default")
    assert default.where("id = 2 AND NOT _cdc_current").count() >= 1  # ended by the truncate
    assert default.where("_cdc_valid_to < _cdc_valid_from").count() == 0


def _operations(spark, path: str) -> list[str]:  # type: ignore[no-untyped-def]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()
    return [h.operation for h in history]


def test_batches_of_new_rows_are_appended_and_others_merged(db18, spark, tmp_path):  # type: ignore[no-untyped-def]
    """A batch whose every key first arrives as an insert is a plain append (no MERGE); a key that
    may exist (re-inserted, updated, deleted), a second writer, or soft deletes keep the MERGE."""
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE n (id int PRIMARY KEY, v text); CREATE PUBLICATION pn FOR TABLE n")
        create_slot(conn, "sn")
        conn.execute("INSERT INTO n SELECT g, 'a' FROM generate_series(1, 10) g")  # new rows
        with conn.transaction():  # new rows only, though updated, re-keyed and deleted on the way
            conn.execute("INSERT INTO n VALUES (11, 'x'), (13, 'y')")
            conn.execute("UPDATE n SET v = 'x2' WHERE id = 11")
            conn.execute("UPDATE n SET id = 12 WHERE id = 11")
            conn.execute("DELETE FROM n WHERE id = 13")
        with conn.transaction():  # a key deleted and inserted again: it existed
            conn.execute("DELETE FROM n WHERE id = 1")
            conn.execute("INSERT INTO n VALUES (1, 'again')")
        conn.execute("INSERT INTO n VALUES (20, 'b')")  # new rows again
        truth = postgres_rows(conn, "public.n", ["id", "v"])
        types = source_types(conn, "public.n")
    capture = tmp_path / "n.jsonl"
    write_jsonl(capture, peek(server, dbname, "sn", PgOutputOptions(("pn",))))
    warehouse = str(tmp_path / "wh")
    path = f"{warehouse}/public/n"
    replay(spark, [str(capture)], ApplyOptions(warehouse=warehouse), max_changes=1)
    assert _operations(spark, path)[-4:] == ["WRITE", "WRITE", "MERGE", "WRITE"]
    assert delta_rows(spark, path, ["id", "v"], types) == truth
    # Another pipeline would be another writer of the same target: refused before it writes anything
    # (docs/operations.md, "The pipeline's state").
    with pytest.raises(TargetOwnedError, match="pipeline 'cdc_apply' writes"):
        replay(spark, [str(capture)], ApplyOptions(warehouse=warehouse, pipeline="other"), max_changes=1)
    assert _operations(spark, path)[-4:] == ["WRITE", "WRITE", "MERGE", "WRITE"]
    assert delta_rows(spark, path, ["id", "v"], types) == truth
    # Soft deletes: a deleted key stays in the target, so only MERGE; snapshot-style appends mark rows live.
    soft = str(tmp_path / "soft")
    options = ApplyOptions(warehouse=soft, defaults=TableOptions(delete_mode="soft"))
    applier = BatchApplier(spark, options)
    assembler = Assembler()
    transactions = list(assembler.transactions(read_captures([str(capture)])))
    applier.apply(transactions[:1], snapshot=True)
    for transaction in transactions[1:]:
        applier.apply([transaction])
    assert _operations(spark, f"{soft}/public/n")[-3:] == ["MERGE"] * 3
    live = delta_rows(spark, f"{soft}/public/n", ["id", "v"], types, where="NOT _cdc_deleted")
    assert live == truth
    assert spark.read.format("delta").load(f"{soft}/public/n").where("_cdc_deleted IS NULL").count() == 0


def test_updates_and_deletes_collapse_as_columns(db18, spark, tmp_path):  # type: ignore[no-untyped-def]
    """Batches of inserts, updates and deletes, many to one key, key changes and unchanged TOAST,
    collapse as Arrow columns (apply/columnar.py) and MERGE to PostgreSQL's rows, with hard and with
    soft deletes; a TOAST value that no change or an earlier change of the key holds is taken as columns, one
    only another key's row holds takes the row-by-row collapse."""
    server, dbname = db18
    columns = ["id", "v", "n", "t", "b"]
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE c (id int PRIMARY KEY, v text, n numeric(10,2), t timestamptz, b text);"
                     "CREATE PUBLICATION pc FOR TABLE c")
        create_slot(conn, "sc")
        big = "(SELECT string_agg(md5(g::text || x::text), '') FROM generate_series(1, 200) x)"  # stored out of line
        conn.execute(f"INSERT INTO c SELECT g, 'a' || g, g / 4.0, now(), CASE WHEN g <= 10 THEN {big} ELSE 's' END "
                     "FROM generate_series(1, 40) g")
        with conn.transaction():  # 3 and 9 send b as unchanged TOAST: kept from the target
            conn.execute("UPDATE c SET v = v || 'u', n = NULL WHERE id % 3 = 0")
            conn.execute("DELETE FROM c WHERE id % 5 = 0")
            conn.execute("INSERT INTO c VALUES (5, 'back', 1.5, NULL), (41, 'new', 2, now()), (42, 'gone', 3, now())")
        with conn.transaction():
            conn.execute("UPDATE c SET v = 'again' WHERE id IN (5, 12, 41)")
            conn.execute("DELETE FROM c WHERE id IN (42, 7)")
        conn.execute("UPDATE c SET id = 100 WHERE id = 8")  # b unchanged TOAST of another key's row: row by row
        conn.execute("UPDATE c SET v = 'toast' WHERE id IN (1, 2)")  # unchanged TOAST, kept from the target
        with conn.transaction():  # two changes of one key, b unchanged TOAST in both: kept from the target
            conn.execute("UPDATE c SET v = 'x' WHERE id = 4")
            conn.execute("UPDATE c SET n = 9 WHERE id = 4")
            # b set, then sent as unchanged TOAST: carried forward from the first change
            conn.execute("UPDATE c SET b = (SELECT string_agg(md5('new' || x::text), '') FROM generate_series(1, 200) x) "
                         "WHERE id = 6")
            conn.execute("UPDATE c SET v = 'y' WHERE id = 6")
        conn.execute("UPDATE c SET id = 200 WHERE id = 11")  # a key change
        truth = postgres_rows(conn, "public.c", columns)
        types = source_types(conn, "public.c")
    capture = tmp_path / "c.jsonl"
    write_jsonl(capture, peek(server, dbname, "sc", PgOutputOptions(("pc",))))
    transactions = list(Assembler().transactions(read_captures([str(capture)])))
    assert len(transactions) == 7
    for delete_mode in ("hard", "soft"):
        warehouse = str(tmp_path / delete_mode)
        applier = BatchApplier(spark, ApplyOptions(warehouse=warehouse, defaults=TableOptions(delete_mode=delete_mode)))
        assert not applier.apply(transactions[:1]).tables[0].columnar  # creates the target
        both = applier.apply(transactions[1:3]).tables[0]
        assert both.columnar and both.write == "merge" and both.ops == {"U": 16, "D": 10, "I": 3}
        assert both.keys_written == 22  # 13 updated and 8 deleted (2 of them both), 41, 42, 7
        taken = [applier.apply([transaction]).tables[0] for transaction in transactions[3:]]
        assert [table.columnar for table in taken] == [False, True, True, True], delete_mode
        assert taken[-1].keys_written == 2  # the old key deleted, the new one written
        where = "NOT _cdc_deleted" if delete_mode == "soft" else None
        assert delta_rows(spark, f"{warehouse}/public/c", columns, types, where=where) == truth, delete_mode
