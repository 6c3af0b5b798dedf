"""schema_policy: evolve against a real server of every version: DROP, RENAME COLUMN, ALTER TYPE ...
USING, SET SCHEMA and RENAME TABLE mid-stream, each followed by changes, applied by ``run --once``
across several batches; the target equals PostgreSQL after each step."""

from __future__ import annotations

import psycopg
import pytest

from cdc_apply.pipeline import drain
from tests.delta_oracle import delta_rows, reader_features, source_types
from tests.once_config import once_config
from tests.reference_apply import postgres_rows


# On 18 alone: the code it reaches that differs by server version runs on 15 in other tests
# (docs/testing.md, "Which tests run on both server versions").
@pytest.mark.spark
def test_evolve_follows_every_schema_change(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = once_config(server, dbname, warehouse, "evo", defaults={"schema_policy": "evolve"},
                         batching={"max_changes": 7})
    target = f"{warehouse}/public/items"  # found by relation OID: renames and SET SCHEMA keep it

    def check(conn, qualified: str, columns: list[str]) -> None:  # type: ignore[no-untyped-def]
        drain(config, spark)
        assert delta_rows(spark, target, columns, source_types(conn, qualified)) == \
            postgres_rows(conn, qualified, columns), qualified

    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, code text, gone text, label text, qty smallint)")
        conn.execute("CREATE SCHEMA archive")
        conn.execute("INSERT INTO items SELECT g, (g * 3)::text, 'g' || g, 'l' || g, g FROM generate_series(1, 12) g")
        check(conn, "public.items", ["id", "code", "gone", "label", "qty"])

        conn.execute("ALTER TABLE items DROP COLUMN gone")
        conn.execute("UPDATE items SET label = 'after drop' WHERE id <= 3")
        conn.execute("ALTER TABLE items RENAME COLUMN label TO title")
        conn.execute("UPDATE items SET title = 'renamed' WHERE id = 4")
        conn.execute("INSERT INTO items VALUES (13, '39', 'new', 13)")
        check(conn, "public.items", ["id", "code", "title", "qty"])

        conn.execute("ALTER TABLE items ALTER COLUMN code TYPE int USING code::int")  # rows rewritten, no WAL
        conn.execute("UPDATE items SET code = code + 1 WHERE id % 2 = 0")
        conn.execute("ALTER TABLE items ALTER COLUMN qty TYPE int")  # a widening
        conn.execute("UPDATE items SET qty = 100000 WHERE id = 5")
        check(conn, "public.items", ["id", "code", "title", "qty"])
        # type_widening: rewrite (the default): the column is cast in an overwrite, so delta-rs still reads it
        assert "typeWidening" not in reader_features(target)

        conn.execute("ALTER TABLE items SET SCHEMA archive")
        conn.execute("UPDATE archive.items SET title = 'moved' WHERE id = 6")
        conn.execute("ALTER TABLE archive.items RENAME TO things")
        conn.execute("DELETE FROM archive.things WHERE id = 7")
        conn.execute("INSERT INTO archive.things VALUES (14, 42, 'last', 14)")
        check(conn, "archive.things", ["id", "code", "title", "qty"])


@pytest.mark.spark
def test_type_widening_feature_widens_in_place(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``type_widening: feature``: Delta's typeWidening instead of a rewrite; Spark reads the widened values."""
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = once_config(server, dbname, warehouse, "wid", defaults={"type_widening": "feature"})
    target = f"{warehouse}/public/w"
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE w (id int PRIMARY KEY, qty smallint)")
        conn.execute("INSERT INTO w SELECT g, g FROM generate_series(1, 5) g")
        drain(config, spark)
        conn.execute("ALTER TABLE w ALTER COLUMN qty TYPE bigint")
        conn.execute("UPDATE w SET qty = 10000000000 WHERE id = 2")
        drain(config, spark)
        assert "typeWidening" in reader_features(target)
        assert delta_rows(spark, target, ["id", "qty"], source_types(conn, "public.w")) == \
            postgres_rows(conn, "public.w", ["id", "qty"])
