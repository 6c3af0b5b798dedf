"""Workloads that make a real server produce every pgoutput message type."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from cdc_apply.pgserver import PgServer
from cdc_apply.sources.slot import PgOutputOptions, create_slot

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE items (id int PRIMARY KEY, name text, qty numeric(12,2), feeling mood, big text);
CREATE TABLE fullrow (a int, b text);
ALTER TABLE fullrow REPLICA IDENTITY FULL;
CREATE TABLE other (id bigint PRIMARY KEY, v text);
CREATE TABLE "Mixed Case" ("Id" int PRIMARY KEY, "Some Value" text);
CREATE PUBLICATION pub FOR TABLE items, fullrow, other, "Mixed Case";
"""
TABLES = {"public.items": ["id", "name", "qty", "feeling", "big", "extra"], "public.fullrow": ["a", "b"],
          "public.other": ["id", "v"], "public.Mixed Case": ["Id", "Some Value"]}
BIG_TEXT = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 600) g)"  # ~19 kB, TOASTed


@dataclass(frozen=True)
class Variant:
    name: str
    slot: str
    options: PgOutputOptions
    two_phase_slot: bool = False
    immediate_streaming: bool = False  # decode with debug_logical_replication_streaming=immediate
    min_version: int = 0
    expected_tags: frozenset[str] = frozenset()


BASE_TAGS = frozenset("BCRYIUDTMO")
STREAM_TAGS = frozenset("SEc")
TWO_PHASE_TAGS = frozenset("bPKrp")


def variants(version_num: int) -> list[Variant]:
    found = [
        Variant("v1", "s_v1", PgOutputOptions(("pub",), 1), expected_tags=BASE_TAGS),
        Variant("v2-stream", "s_v2", PgOutputOptions(("pub",), 2, streaming="on"),
                expected_tags=BASE_TAGS | STREAM_TAGS),
        Variant("v3-twophase", "s_v3", PgOutputOptions(("pub",), 3, streaming="on"), two_phase_slot=True,
                expected_tags=BASE_TAGS | STREAM_TAGS | TWO_PHASE_TAGS),
        Variant("v2-immediate", "s_v2", PgOutputOptions(("pub",), 2, streaming="on"), immediate_streaming=True,
                min_version=160000, expected_tags=frozenset("SEcAIUDTRY")),
        Variant("v4-parallel", "s_v4", PgOutputOptions(("pub",), 4, streaming="parallel", origin="any"),
                two_phase_slot=True, immediate_streaming=True, min_version=160000,
                expected_tags=frozenset("SEcApKr")),
    ]
    return [v for v in found if version_num >= v.min_version]


def run_golden_workload(server: PgServer, dbname: str, slots: dict[str, bool]) -> None:
    """Creates the schema, the slots (name -> two_phase), then runs every kind of change."""
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute(SCHEMA)
        for slot, two_phase in slots.items():
            create_slot(conn, slot, two_phase=two_phase)
        run = conn.execute
        run("INSERT INTO items VALUES (1, 'one', 1.50, 'ok', NULL), (2, 'two', 2.25, 'sad', NULL)")
        run("INSERT INTO fullrow VALUES (1, 'a'), (2, 'b'), (3, 'c')")
        run("""INSERT INTO "Mixed Case" VALUES (1, 'x y')""")
        run(f"INSERT INTO items VALUES (3, 'toasty', 3.00, 'happy', {BIG_TEXT})")
        with conn.transaction():
            run("UPDATE items SET qty = qty + 1 WHERE id = 3")  # big is sent as unchanged TOAST ('u')
            run("UPDATE items SET id = 103 WHERE id = 1")  # key change: 'K' image
        run("UPDATE fullrow SET b = 'bb' WHERE a = 2")  # 'O' image
        run("DELETE FROM fullrow WHERE a = 3")
        run("DELETE FROM items WHERE id = 2")
        run("SELECT pg_logical_emit_message(true, 'cdc', 'transactional')")
        run("SELECT pg_logical_emit_message(false, 'cdc', 'not transactional')")
        run("INSERT INTO other SELECT g, 'row ' || g FROM generate_series(1, 10) g")
        with conn.transaction():
            run("INSERT INTO other VALUES (1000, 'before truncate')")
            run("TRUNCATE other, fullrow")
            run("INSERT INTO other VALUES (1001, 'after truncate')")
        run("ALTER TABLE items ADD COLUMN extra int")
        run("INSERT INTO items VALUES (4, 'four', 4, 'ok', NULL, 44)")
        # A streamed transaction with a rolled-back subtransaction.
        with conn.transaction():
            run("INSERT INTO other SELECT g, repeat('s', 200) FROM generate_series(2000, 3999) g")
            run("SAVEPOINT sp")
            run("INSERT INTO other SELECT g, 'rolled back' FROM generate_series(5000, 5999) g")
            run("ROLLBACK TO SAVEPOINT sp")
            run("UPDATE other SET v = 'kept' WHERE id BETWEEN 2000 AND 2100")
        # A streamed transaction that aborts as a whole.
        conn.execute("BEGIN")
        run("INSERT INTO other SELECT g, repeat('x', 200) FROM generate_series(6000, 7999) g")
        conn.execute("ROLLBACK")
        # Two-phase: commit, rollback, and a large (streamed) prepared transaction.
        for gid, outcome, rows in (("g1", "COMMIT", 3), ("g2", "ROLLBACK", 3), ("g3", "COMMIT", 3000)):
            conn.execute("BEGIN")
            run(f"INSERT INTO other SELECT g, '{gid}' FROM generate_series(10000, {10000 + rows - 1}) g ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v")
            run(f"PREPARE TRANSACTION '{gid}'")
            run(f"{outcome} PREPARED '{gid}'")
        run("DELETE FROM other WHERE id % 3 = 0 AND id >= 10000")
    # Changes that came from elsewhere carry an Origin message.
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        # Origins are cluster-wide: a second run on the same server (a module fixture set up again
        # when pytest-xdist moves tests between workers) finds it there.
        conn.execute("SELECT pg_replication_origin_create('upstream') WHERE NOT EXISTS "
                     "(SELECT FROM pg_replication_origin WHERE roname = 'upstream')")
        conn.execute("SELECT pg_replication_origin_session_setup('upstream')")
        with conn.transaction():
            conn.execute("SELECT pg_replication_origin_xact_setup('0/AB', now())")
            conn.execute("INSERT INTO items VALUES (5, 'from upstream', 5, 'ok', NULL, 55)")
