"""Faithful to what PostgreSQL publishes: several publications, published generated columns, replica
identity switches. Each workload is copied, streamed and applied by ``run --once``, and every target
must equal the PostgreSQL table (or the rows its publications publish), read by Spark and delta-rs."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.pipeline import drain
from cdc_apply.resync import published_oids, resync
from cdc_apply.status import pipeline_status
from tests.delta_oracle import delta_rows, source_types
from tests.once_config import once_config
from tests.reference_apply import postgres_rows


def _config(server: Any, dbname: str, warehouse: str, pipeline: str, publication: str | list[str], **sections: Any):  # type: ignore[no-untyped-def]
    return parse_config({"pipeline": pipeline, "source": {"dsn": server.conninfo(dbname), "slot": pipeline,
                                                          "publication": publication},
                         "target": {"warehouse": warehouse}, **sections})


def _published_rows(conn: Any, qualified: str, columns: list[str], where: str) -> list[tuple[str | None, ...]]:
    schema, _, table = qualified.partition(".")
    select = ", ".join(f'"{c}"::text' for c in columns)
    return sorted((tuple(r) for r in conn.execute(f'SELECT {select} FROM "{schema}"."{table}" WHERE {where}')),
                  key=repr)


# On 18 alone: the code it reaches that differs by server version runs on 15 in other tests
# (docs/testing.md, "Which tests run on both server versions").
@pytest.mark.spark
def test_two_overlapping_publications_one_with_a_row_filter(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``source.publication: [a, b]``: a table in both is sent once, its row filters OR-ed as pgoutput
    combines them; preflight, the copy, the stream, status and resync all see both publications."""
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = _config(server, dbname, warehouse, "pubs", ["low pub", "high"], batching={"max_changes": 5})
    columns = ["id", "v", "note"]
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        for table in ("shared", "only_low", "only_high"):
            conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, note text)")
            conn.execute(f"INSERT INTO {table} SELECT g, g, 'n' || g FROM generate_series(1, 12) g")
        conn.execute('CREATE PUBLICATION "low pub" FOR TABLE shared WHERE (id < 4), only_low')
        conn.execute("CREATE PUBLICATION high FOR TABLE shared WHERE (id > 9), only_high")
        filtered = "id < 4 OR id > 9"  # a row filter of an updated table names identity columns

        def check() -> None:
            drain(config, spark)
            types = source_types(conn, "public.shared")
            assert delta_rows(spark, f"{warehouse}/public/shared", columns, types) == \
                _published_rows(conn, "public.shared", columns, filtered)
            for table in ("only_low", "only_high"):
                assert delta_rows(spark, f"{warehouse}/public/{table}", columns, types) == \
                    postgres_rows(conn, f"public.{table}", columns), table

        check()  # the copy: 3 + 3 rows of shared, every row of the others
        conn.execute("UPDATE shared SET id = id + 30 WHERE id IN (2, 5)")  # across the filters, and into them
        conn.execute("UPDATE shared SET id = 0 WHERE id = 10")  # within them
        conn.execute("DELETE FROM shared WHERE id = 7")  # not published: nothing sent
        conn.execute("UPDATE shared SET id = 7 WHERE id = 11")  # out of them
        conn.execute("UPDATE shared SET note = 'changed', v = -1 WHERE id IN (1, 12)")
        conn.execute("DELETE FROM shared WHERE id IN (3, 35)")
        conn.execute("INSERT INTO shared VALUES (20, 0, 'low'), (21, 6, 'middle'), (22, 30, 'high')")
        conn.execute("UPDATE only_low SET v = -v WHERE id % 2 = 0")
        conn.execute("DELETE FROM only_high WHERE id > 8")
        check()

        status = pipeline_status(config)
        assert status["publication"] == {"names": ["low pub", "high"], "exists": True, "missing": []}
        assert {t["table"] for t in status["tables"]} == {"public.shared", "public.only_low", "public.only_high"}

        conn.execute("UPDATE shared SET v = 100 WHERE id = 1")  # on the slot, and in the new copy
        resync(config, spark, published_oids(config, ["public.shared"]))  # the copy again, filters combined
        check()
        conn.execute('DROP PUBLICATION "low pub"')
        assert pipeline_status(config)["publication"]["missing"] == ["low pub"]


@pytest.mark.spark
def test_a_publication_name_list_is_checked(any_db) -> None:  # type: ignore[no-untyped-def]
    server, dbname = any_db
    from cdc_apply.errors import CdcApplyError
    from cdc_apply.pipeline import prepare_source

    config = _config(server, dbname, "/tmp/unused", "pubcheck", ["here", "nowhere"])
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION here FOR ALL TABLES")
    with pytest.raises(CdcApplyError, match="publication 'nowhere' does not exist"):
        prepare_source(config)


@pytest.mark.spark
@pytest.mark.parametrize("published_by", ["column list", "publish_generated_columns"])
def test_generated_columns_published_by_postgresql_18(db18, spark, tmp_path, published_by: str) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL 18 sends a stored generated column when a column list names it or with
    ``publish_generated_columns = stored``: the copy holds its values, the stream keeps them, a
    resync copies them again."""
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = _config(server, dbname, warehouse, "gen", "gen")
    columns = ["id", "x", "twice"]
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE g (id int PRIMARY KEY, x int, twice int GENERATED ALWAYS AS (2 * x) STORED, "
                     "hidden int GENERATED ALWAYS AS (3 * x) STORED)")
        conn.execute("INSERT INTO g (id, x) SELECT i, i FROM generate_series(1, 10) i")
        if published_by == "column list":
            conn.execute("CREATE PUBLICATION gen FOR TABLE g (id, x, twice)")
        else:
            conn.execute("CREATE PUBLICATION gen FOR TABLE g WITH (publish_generated_columns = stored)")
            columns.append("hidden")
        target = f"{warehouse}/public/g"

        def check() -> None:
            drain(config, spark)
            assert delta_rows(spark, target, columns, source_types(conn, "public.g")) == \
                postgres_rows(conn, "public.g", columns)

        check()
        conn.execute("UPDATE g SET x = x + 100 WHERE id <= 3")
        conn.execute("INSERT INTO g (id, x) VALUES (11, 7)")
        conn.execute("DELETE FROM g WHERE id = 10")
        check()
        resync(config, spark, published_oids(config, ["public.g"]))
        check()


# On 18 alone: the code it reaches that differs by server version runs on 15 in other tests
# (docs/testing.md, "Which tests run on both server versions").
@pytest.mark.spark
def test_replica_identity_switches_keep_the_target_equal(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """DEFAULT -> FULL -> DEFAULT and DEFAULT -> USING INDEX (another key) -> DEFAULT, with updates and
    deletes in between, inside one batch and across batches; a keyless FULL table that gets a primary
    key. No copy again: the target is re-keyed in place."""
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = once_config(server, dbname, warehouse, "ri")
    columns = ["id", "code", "v", "note"]
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE ri (id int PRIMARY KEY, code text NOT NULL UNIQUE, v int, note text)")
        conn.execute("INSERT INTO ri SELECT g, 'c' || g, g, repeat('x', g) FROM generate_series(1, 20) g")
        conn.execute("CREATE TABLE bag (a int, b text)")  # no key: FULL keys it by the whole row
        conn.execute("ALTER TABLE bag REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO bag SELECT g, 'b' || g FROM generate_series(1, 6) g")

        def check() -> None:
            drain(config, spark)
            assert delta_rows(spark, f"{warehouse}/public/ri", columns, source_types(conn, "public.ri")) == \
                postgres_rows(conn, "public.ri", columns)
            assert delta_rows(spark, f"{warehouse}/public/bag", ["a", "b"], source_types(conn, "public.bag")) == \
                postgres_rows(conn, "public.bag", ["a", "b"])

        def check_rekeyed_inside_the_batch(table: str, before: list[str], after: list[str]) -> None:
            caplog.clear()
            with caplog.at_level("INFO", logger="cdc_apply.apply.batch"):
                check()
            assert f"public.{table}: re-keyed from {before} to {after} inside the batch" in caplog.text

        check()
        # One batch: DEFAULT -> FULL -> DEFAULT, changes under each.
        conn.execute("UPDATE ri SET v = -v WHERE id <= 2")
        conn.execute("ALTER TABLE ri REPLICA IDENTITY FULL")
        conn.execute("UPDATE ri SET v = v * 10, note = 'full' WHERE id BETWEEN 2 AND 4")
        conn.execute("UPDATE ri SET id = 40 WHERE id = 5")
        conn.execute("DELETE FROM ri WHERE id IN (1, 6)")
        conn.execute("ALTER TABLE ri REPLICA IDENTITY DEFAULT")
        conn.execute("UPDATE ri SET note = 'default again' WHERE id IN (3, 40)")
        conn.execute("DELETE FROM ri WHERE id = 7")
        conn.execute("INSERT INTO ri VALUES (1, 'c1', 1, 'back')")
        # The keyless table gets a primary key in the same batch: whole-row key -> id.
        conn.execute("UPDATE bag SET b = 'changed' WHERE a = 2")
        conn.execute("DELETE FROM bag WHERE a = 3")
        conn.execute("ALTER TABLE bag ADD PRIMARY KEY (a)")
        conn.execute("ALTER TABLE bag REPLICA IDENTITY DEFAULT")
        conn.execute("UPDATE bag SET b = 'keyed' WHERE a IN (1, 2)")
        conn.execute("DELETE FROM bag WHERE a = 4")
        conn.execute("INSERT INTO bag VALUES (3, 'again')")
        check_rekeyed_inside_the_batch("bag", ["a", "b"], ["a"])

        # Across batches: FULL, then changes, then DEFAULT.
        conn.execute("ALTER TABLE ri REPLICA IDENTITY FULL")
        conn.execute("UPDATE ri SET v = 0 WHERE id = 8")
        check()
        conn.execute("DELETE FROM ri WHERE id = 9")
        conn.execute("UPDATE ri SET id = 50, note = 'moved' WHERE id = 10")
        check()
        conn.execute("ALTER TABLE ri REPLICA IDENTITY DEFAULT")
        conn.execute("UPDATE ri SET v = 1 WHERE id = 50")
        check()

        # One batch: DEFAULT -> USING INDEX on code, with the old key's changes before and code changes after.
        conn.execute("UPDATE ri SET code = 'first', note = 'by id' WHERE id = 11")
        conn.execute("DELETE FROM ri WHERE id = 12")
        conn.execute("ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_code_key")
        conn.execute("UPDATE ri SET code = 'c12' WHERE id = 13")  # takes the deleted row's code
        conn.execute("UPDATE ri SET v = 99 WHERE code = 'first'")
        conn.execute("DELETE FROM ri WHERE code = 'c14'")
        conn.execute("UPDATE ri SET id = 60 WHERE code = 'c15'")
        conn.execute("INSERT INTO ri VALUES (12, 'new12', 12, 'by code')")
        check_rekeyed_inside_the_batch("ri", ["id"], ["code"])
        # Across batches: back to DEFAULT, then USING INDEX again.
        conn.execute("ALTER TABLE ri REPLICA IDENTITY DEFAULT")
        conn.execute("UPDATE ri SET code = 'c16b' WHERE id = 16")
        check()
        conn.execute("ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_code_key")
        conn.execute("UPDATE ri SET code = 'c17b', v = 7 WHERE id = 17")
        check()
        conn.execute("DELETE FROM ri WHERE code = 'c18'")
        conn.execute("UPDATE ri SET note = NULL WHERE code = 'c17b'")
        check()
