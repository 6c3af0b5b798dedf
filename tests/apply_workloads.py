"""A workload for the apply: every replica identity, TOAST, key changes, truncate, schema changes,
a table rename and partitioned tables, captured through two publications (partition root on/off)."""

from __future__ import annotations

import psycopg

from cdc_apply.pgserver import PgServer
from cdc_apply.sources.slot import create_slot
from tests.workloads import BIG_TEXT

SCHEMA = """
CREATE TABLE ident_default (id int PRIMARY KEY, v text);
CREATE TABLE ident_index (a int NOT NULL, b int NOT NULL, v text, CONSTRAINT ab UNIQUE (a, b));
ALTER TABLE ident_index REPLICA IDENTITY USING INDEX ab;
CREATE TABLE ident_full (a int, b text);
ALTER TABLE ident_full REPLICA IDENTITY FULL;
CREATE TABLE ident_nothing (a int, b text);
ALTER TABLE ident_nothing REPLICA IDENTITY NOTHING;
CREATE TABLE docs (id int PRIMARY KEY, title text, body text, n int);
CREATE TABLE evolving (id int PRIMARY KEY, a int, b text, c text, d numeric(10,2));
CREATE TABLE measures (id int, region text, v int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE measures_eu PARTITION OF measures FOR VALUES IN ('eu');
CREATE TABLE measures_us PARTITION OF measures FOR VALUES IN ('us');
CREATE PUBLICATION pub_root FOR TABLE ident_default, ident_index, ident_full, ident_nothing, docs, evolving, measures
  WITH (publish_via_partition_root = true);
CREATE PUBLICATION pub_leaf FOR TABLE ident_default, ident_index, ident_full, ident_nothing, docs, evolving, measures;
"""

# Tables as PostgreSQL has them at the end: name -> (Delta path under the warehouse, columns)
COMMON = {
    "public.ident_default": ("public/ident_default", ["id", "v"]),
    "public.ident_index": ("public/ident_index", ["a", "b", "v"]),
    "public.ident_full": ("public/ident_full", ["a", "b"]),
    "public.ident_nothing": ("public/ident_nothing", ["a", "b"]),
    "public.docs": ("public/docs", ["id", "title", "body", "n"]),
    "public.evolved": ("public/evolving", ["id", "a", "b2", "d", "e"]),  # renamed table keeps its target
}
ROOT_TABLES = {**COMMON, "public.measures": ("public/measures", ["id", "region", "v"])}
LEAF_TABLES = {**COMMON, "public.measures_eu": ("public/measures_eu", ["id", "region", "v"]),
               "public.measures_us": ("public/measures_us", ["id", "region", "v"])}


def run_apply_workload(server: PgServer, dbname: str) -> None:
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute(SCHEMA)
        create_slot(conn, "s_root")
        create_slot(conn, "s_leaf")
        run = conn.execute
        run("INSERT INTO ident_default SELECT g, 'v' || g FROM generate_series(1, 20) g")
        run("INSERT INTO ident_index SELECT g, g * 10, 'v' || g FROM generate_series(1, 5) g")
        run("INSERT INTO ident_full VALUES (1, 'a'), (2, NULL), (3, 'c')")
        run("INSERT INTO ident_nothing VALUES (1, 'x'), (2, 'y')")
        run("INSERT INTO evolving SELECT g, g, 'b' || g, 'c' || g, g / 3.0 FROM generate_series(1, 6) g")
        run("INSERT INTO measures SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g FROM generate_series(1, 8) g")
        # TOAST values (> 8 kB), then updates of other columns: the big values arrive as unchanged ('u').
        run(f"INSERT INTO docs VALUES (1, 'one', {BIG_TEXT}, 1), (5, 'five', {BIG_TEXT} || 'five', 5)")
        run("UPDATE docs SET n = 2 WHERE id = 1")
        with conn.transaction():  # insert and update of one key in one transaction
            run(f"INSERT INTO docs VALUES (2, 'two', {BIG_TEXT} || 'two', 1)")
            run("UPDATE docs SET n = 3, title = 'zwei' WHERE id = 2")
        run("UPDATE docs SET id = 10 WHERE id = 1")  # key change; body unchanged TOAST from the old key's row
        run("UPDATE docs SET title = 'ten' WHERE id = 10")
        run("UPDATE docs SET id = 50, n = 50 WHERE id = 5")
        # Replica identities: index key change, FULL update with NULLs, delete; NOTHING gets inserts only.
        run("UPDATE ident_index SET v = 'changed' WHERE a = 2")
        run("UPDATE ident_index SET b = 999 WHERE a = 3")
        run("DELETE FROM ident_index WHERE a = 4")
        run("UPDATE ident_full SET b = 'two' WHERE a = 2")
        run("UPDATE ident_full SET a = 30 WHERE a = 3")
        run("DELETE FROM ident_full WHERE a = 1")
        run("INSERT INTO ident_nothing VALUES (3, 'z')")
        run("UPDATE ident_default SET v = 'upd' WHERE id <= 5")
        run("UPDATE ident_default SET id = 100 WHERE id = 6")
        run("DELETE FROM ident_default WHERE id BETWEEN 7 AND 9")
        # Schema changes in the middle of the stream, each followed by changes.
        run("ALTER TABLE evolving ADD COLUMN e int")
        run("UPDATE evolving SET e = id * 100 WHERE id <= 3")
        run("INSERT INTO evolving VALUES (7, 7, 'b7', 'c7', 7.77, 700)")
        run("ALTER TABLE evolving DROP COLUMN c")
        run("UPDATE evolving SET a = a + 1 WHERE id = 1")
        run("ALTER TABLE evolving RENAME COLUMN b TO b2")
        run("UPDATE evolving SET b2 = 'renamed' WHERE id = 2")
        run("ALTER TABLE evolving ALTER COLUMN a TYPE bigint")
        run("UPDATE evolving SET a = 5000000000 WHERE id = 3")
        run("ALTER TABLE evolving ALTER COLUMN d TYPE numeric(14,2)")
        run("UPDATE evolving SET d = 123456789.12 WHERE id = 4")
        run("ALTER TABLE evolving ALTER COLUMN e TYPE text")  # a USING expression could not be followed
        run("UPDATE evolving SET e = 'text now' WHERE id = 5")
        run("ALTER TABLE evolving RENAME TO evolved")
        run("INSERT INTO evolved VALUES (8, 8, 'b8', 8.8, 'eight')")
        run("DELETE FROM evolved WHERE id = 6")
        # Truncate of several tables, with changes before and after it in one transaction.
        with conn.transaction():
            run("INSERT INTO ident_default VALUES (500, 'before')")
            run("UPDATE docs SET n = 99 WHERE id = 2")
            run("TRUNCATE ident_default, ident_nothing")
            run("INSERT INTO ident_default VALUES (501, 'after'), (1, 'again')")
            run("INSERT INTO ident_nothing VALUES (9, 'after'), (10, 'after'), (10, 'after')")
        run("UPDATE ident_default SET v = 'after2' WHERE id = 1")
        # Partitions: updates, a cross-partition move, deletes.
        run("UPDATE measures SET v = v * 10 WHERE id <= 4")
        run("UPDATE measures SET region = 'eu' WHERE id = 5")
        run("DELETE FROM measures WHERE id = 8")
        # A streamed transaction with a rolled-back savepoint.
        conn.execute("SET logical_decoding_work_mem = '64kB'")
        with conn.transaction():
            run("INSERT INTO ident_default SELECT g, repeat('s', 100) FROM generate_series(1000, 2999) g")
            run("SAVEPOINT sp")
            run("UPDATE ident_default SET v = 'rolled back' WHERE id >= 1000")
            run("ROLLBACK TO SAVEPOINT sp")
            run("DELETE FROM ident_default WHERE id BETWEEN 1000 AND 1500")
