"""Tables without a key, on every server version: CREATE TABLE AS (insert-only, identical rows kept,
truncate empties it), a primary key added later (keyed from then on, across batches and inside
one), and REPLICA IDENTITY FULL without a key (rows matched on the whole old row, NULLs included;
identical rows kept apart, an UPDATE or DELETE of one of them changes exactly one).
"""

from __future__ import annotations

import psycopg
import pytest

from cdc_apply.pipeline import drain
from tests.delta_oracle import delta_rows, source_types
from tests.once_config import once_config
from tests.reference_apply import postgres_rows

TABLES = {"public.ctas": ["id", "v"], "public.late": ["id", "v"], "public.full_nokey": ["a", "b"]}


def _assert_equal(spark, conn, warehouse: str) -> None:  # type: ignore[no-untyped-def]
    for name, columns in TABLES.items():
        truth = postgres_rows(conn, name, columns)
        got = delta_rows(spark, f"{warehouse}/{name.replace('.', '/')}", columns, source_types(conn, name))
        assert got == truth, name


# On 18 alone: the code it reaches that differs by server version runs on 15 in other tests
# (docs/testing.md, "Which tests run on both server versions").
@pytest.mark.spark
def test_keyless_tables_are_applied_and_a_later_key_takes_over(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = once_config(server, dbname, warehouse, "keyless", batching={"max_changes": 1000})
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE src (id int, v text)")
        conn.execute("INSERT INTO src SELECT g, 'v' || g FROM generate_series(1, 20) g")
        conn.execute("CREATE TABLE ctas AS SELECT * FROM src")  # replica identity default, no key
        conn.execute("CREATE TABLE late (id int NOT NULL, v text)")
        conn.execute("SELECT 1 AS a, NULL::text AS b INTO full_nokey")
        conn.execute("INSERT INTO full_nokey VALUES (1, NULL), (5, 'five'), (5, 'five'), (5, 'five')")
        conn.execute("ALTER TABLE full_nokey REPLICA IDENTITY FULL")
        first = drain(config, spark)  # creates publication and slot, copies the three tables
        assert sorted(s.table for s in first.snapshots) == ["public.ctas", "public.full_nokey", "public.late", "public.src"]
        _assert_equal(spark, conn, warehouse)

        conn.execute("INSERT INTO ctas VALUES (1, 'v1'), (1, 'v1'), (NULL, NULL)")  # identical rows stay apart
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            conn.execute("UPDATE ctas SET v = 'x' WHERE id = 1")  # what makes insert-only safe
        conn.execute("INSERT INTO late SELECT g, 'l' || g FROM generate_series(1, 10) g")
        conn.execute("INSERT INTO full_nokey VALUES (2, NULL), (3, 'c'), (NULL, 'n')")
        conn.execute("UPDATE full_nokey SET b = 'was null' WHERE ctid = (SELECT min(ctid) FROM full_nokey WHERE a = 1)")
        conn.execute("DELETE FROM full_nokey WHERE a IS NULL")
        conn.execute("DELETE FROM full_nokey WHERE ctid = (SELECT min(ctid) FROM full_nokey WHERE a = 5)")
        conn.execute("INSERT INTO full_nokey VALUES (3, 'c'), (3, 'c')")
        drain(config, spark)
        _assert_equal(spark, conn, warehouse)
        with conn.transaction():  # one of three identical rows changed, one removed, in one transaction
            conn.execute("UPDATE full_nokey SET a = 33 WHERE ctid = (SELECT min(ctid) FROM full_nokey WHERE a = 3)")
            conn.execute("DELETE FROM full_nokey WHERE ctid = (SELECT min(ctid) FROM full_nokey WHERE a = 5)")
        conn.execute("INSERT INTO full_nokey VALUES (5, 'five')")
        drain(config, spark)
        _assert_equal(spark, conn, warehouse)
        assert postgres_rows(conn, "public.full_nokey", ["a", "b"]).count(("5", "five")) == 2

        conn.execute("TRUNCATE ctas")
        conn.execute("INSERT INTO ctas SELECT g, 't' || g FROM generate_series(1, 5) g")
        conn.execute("ALTER TABLE ctas ADD PRIMARY KEY (id)")  # in a batch of its own, below
        drain(config, spark)
        _assert_equal(spark, conn, warehouse)
        conn.execute("UPDATE ctas SET v = 'keyed' WHERE id <= 2")
        conn.execute("UPDATE ctas SET id = 50 WHERE id = 5")
        conn.execute("DELETE FROM ctas WHERE id = 3")
        # Inside one batch: inserts without a key, the key, then updates and deletes by it.
        conn.execute("INSERT INTO late VALUES (11, 'eleven')")
        conn.execute("ALTER TABLE late ADD PRIMARY KEY (id)")
        conn.execute("UPDATE late SET v = 'upd' WHERE id IN (1, 11)")
        conn.execute("DELETE FROM late WHERE id = 2")
        conn.execute("INSERT INTO late VALUES (2, 'again')")
        result = drain(config, spark)
        assert len(result.batches) == 1
        _assert_equal(spark, conn, warehouse)
