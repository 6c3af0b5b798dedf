"""The MERGE's key filter (docs/apply.md, "What a MERGE reads"): the condition it adds on the target,
and a MERGE that carries it, with the table still equal to what the batch says."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_apply.apply.key_filter import IN_LIST_MAX, key_filter


def test_the_filter_names_the_batch_keys_on_the_target() -> None:
    assert key_filter(["id"], {"id": "bigint"}, {"id": [3, 1, 2, 3]}) == "t.`id` IN (1, 2, 3)"
    # Text keys are quoted; NULL keys (a whole-row key may hold one) are kept by IS NULL.
    assert key_filter(["k"], {"k": "string"}, {"k": ["it's", None]}) == "(t.`k` IN ('it\\'s') OR t.`k` IS NULL)"
    # A composite key: a term per column, each a necessary condition of the match.
    assert key_filter(["a", "b"], {"a": "int", "b": "decimal(10,2)"}, {"a": [1, 2], "b": [Decimal("1.50")]}) == \
        "t.`a` IN (1, 2) AND t.`b` IN (CAST('1.50' AS decimal(10,2)))"
    many = list(range(IN_LIST_MAX + 1))
    assert key_filter(["id"], {"id": "int"}, {"id": many}) == f"t.`id` BETWEEN 0 AND {IN_LIST_MAX}"
    # Keys whose values are not written as literals leave the condition as it was.
    assert key_filter(["f"], {"f": "double"}, {"f": [1.5]}) is None
    assert key_filter(["id", "f"], {"id": "int", "f": "double"}, {"id": [7], "f": [1.5]}) == "t.`id` IN (7)"
    assert key_filter(["id"], {"id": "int"}, {"id": []}) is None


@pytest.mark.spark
def test_a_merge_reads_with_the_filter_and_writes_what_the_batch_says(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    from cdc_apply.apply.options import ApplyOptions
    from cdc_apply.replay import replay
    from cdc_apply.sources.capture import write_jsonl
    from cdc_apply.sources.slot import PgOutputOptions, create_slot
    from tests.capture_helpers import peek

    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, name text NOT NULL, v int)")
        conn.execute("CREATE TABLE c (a text, b bigint, v int, PRIMARY KEY (a, b))")
        conn.execute("CREATE PUBLICATION pub FOR TABLE t, c")
        create_slot(conn, "s")
        conn.execute("INSERT INTO t SELECT g, 'n' || g, g FROM generate_series(1, 2000) g")
        conn.execute("INSERT INTO c SELECT 'k' || (g % 7), g, g FROM generate_series(1, 500) g")
        first = peek(server, dbname, "s", PgOutputOptions(("pub",), proto_version=2))
        conn.execute("UPDATE t SET v = -v WHERE id IN (5, 1500)")
        conn.execute("UPDATE t SET id = 3000 WHERE id = 7")  # a key change: the old key is deleted
        conn.execute("DELETE FROM t WHERE id = 1999")
        conn.execute("UPDATE c SET v = 0 WHERE b IN (3, 400)")
        second = peek(server, dbname, "s", PgOutputOptions(("pub",), proto_version=2))  # both: versions skip the first
        truth = {table: sorted(conn.execute(f"SELECT * FROM {table}").fetchall()) for table in ("t", "c")}

    options = ApplyOptions(warehouse=str(tmp_path / "wh"))
    for number, raws in enumerate((first, second)):
        path = tmp_path / f"{number}.jsonl"
        write_jsonl(path, raws)
        replay(spark, [str(path)], options)
    predicates = {}
    for table in ("t", "c"):
        location = str(tmp_path / "wh" / "public" / table)
        merge = spark.sql(f"DESCRIBE HISTORY delta.`{location}` LIMIT 1").collect()[0]
        assert merge["operation"] == "MERGE", merge
        predicates[table] = merge["operationParameters"]["predicate"]
        got = sorted(tuple(row) for row in spark.read.format("delta").load(location)
                     .drop("_cdc_commit_lsn", "_cdc_commit_ts").collect())
        assert got == truth[table], table
        by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(location).scan()).read_all() \
            .drop_columns(["_cdc_commit_lsn", "_cdc_commit_ts"])
        assert sorted(tuple(row.values()) for row in by_delta_rs.to_pylist()) == truth[table], table
    # Delta records the analysed condition: "... AND id#12 IN (5,7,1500,1999,3000)"
    assert "IN (5,7,1500,1999,3000)" in predicates["t"], predicates
    assert "IN (k1,k3)" in predicates["c"] and "IN (3,400)" in predicates["c"], predicates
