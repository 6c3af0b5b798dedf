"""One type per column whatever path writes it (docs/types.md): the type matrix copied, then streamed.

A table of built-in types (ranges, multiranges, arrays, NULL elements), enums, domains over domains
and over an array, a composite holding a composite with a dropped attribute, and arrays of these,
plus a keyless REPLICA IDENTITY FULL table with identical rows. Rows exist before the pipeline's
slot (the first `run --once` copies them); changes follow (the second streams them). On PostgreSQL
15 and 18, in text and binary mode, every target equals PostgreSQL's table value by value, read by
Spark and by delta-rs, and has the schema a stream-only pipeline gives and `format("pgoutput")`
reads from the live slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.pgtypes import PgType
from cdc_apply.pgtypes.exact_text import array_literal
from cdc_apply.sources.slot import create_slot
from tests.delta_oracle import delta_rows, source_types

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN smallpos AS posint CHECK (VALUE < 1000);
CREATE DOMAIN intlist AS int4[];
CREATE TYPE inner_t AS (a int4, gone int4, b text, m mood);
ALTER TYPE inner_t DROP ATTRIBUTE gone;
CREATE TYPE outer_t AS (i inner_t, n numeric, tags text[]);
CREATE TABLE matrix (
    id int PRIMARY KEY, c_bool bool, c_i2 int2, c_i8 int8, c_num numeric(12,2), c_numx numeric, c_text text,
    c_bytea bytea, c_date date, c_ts timestamp, c_tstz timestamptz, c_uuid uuid, c_jsonb jsonb, c_inet inet,
    c_bits varbit, c_range int4range, c_tsrange tstzrange, c_multi int4multirange, c_nummulti nummultirange,
    c_lsn pg_lsn, c_ints int4[], c_texts text[], c_dates date[], c_multis int4multirange[],
    c_mood mood, c_moods mood[], c_small smallpos, c_list intlist, c_outer outer_t, c_inners inner_t[]);
CREATE TABLE keyless (a int, moods mood[], o outer_t);
ALTER TABLE keyless REPLICA IDENTITY FULL;
CREATE PUBLICATION pub FOR TABLE matrix, keyless;
"""
FULL = ("true, 1, -9223372036854775808, -12.34, 'NaN', 'héllo, \"wörld\"', '\\x00ff'::bytea, '0044-03-15 BC', "
        "'2024-02-29 12:34:56.789', '2024-02-29 12:34:56.789+02', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', "
        "'{\"b\": 1, \"a\": [true, null]}', '2001:db8::1/64', B'10101', '[1,10)', '[2024-01-01 00:00:00+00,)', "
        "'{[1,3),[5,7)}', '{[1.5,2.5], (3,)}', '16/B374D848', '{1,NULL,3}', '{\"a b\",NULL,\"c,d\"}', "
        "'{2024-01-01,infinity}', ARRAY['{[1,2)}'::int4multirange, '{}', NULL], 'ok', '{sad,NULL,happy}', 12, "
        "'{{1,2},{3,4}}', ROW(ROW(1, 'x y', 'sad')::inner_t, 3.14, '{a,\"b c\"}')::outer_t, "
        "ARRAY[ROW(1, 'one', 'ok')::inner_t, NULL, ROW(NULL, NULL, NULL)::inner_t]")
EMPTY = ("false, NULL, 0, 0, '-Infinity', '', ''::bytea, 'infinity', NULL, NULL, NULL, 'null', '10.0.0.0/8', "
         "B'', 'empty', NULL, '{}', NULL, '0/0', '{}', '{}', '{}', '{}', NULL, '{}', 1, '{}', "
         "ROW(NULL, NULL, '{}')::outer_t, '{}'")
NULLS = ", ".join(["NULL"] * 29)
BEFORE = [  # rows the copy takes
    f"INSERT INTO matrix VALUES (1, {FULL}), (2, {EMPTY}), (3, {NULLS})",
    "INSERT INTO keyless VALUES (1, '{sad}', ROW(NULL, 1, NULL)), (1, '{sad}', ROW(NULL, 1, NULL)), (2, NULL, NULL)",
]
AFTER = [  # changes the stream takes
    f"INSERT INTO matrix VALUES (4, {FULL}), (5, {EMPTY})",
    "UPDATE matrix SET c_moods = '{happy}', c_outer.n = 2.5, c_multi = '{[0,1)}', c_list = '{7}' WHERE id = 1",
    "UPDATE matrix SET c_inners = ARRAY[ROW(9, 'nine', 'sad')::inner_t], c_small = 999 WHERE id = 3",
    "DELETE FROM matrix WHERE id = 2",
    "UPDATE matrix SET id = 6, c_mood = 'happy' WHERE id = 5",
    "INSERT INTO keyless VALUES (1, '{sad}', ROW(NULL, 1, NULL)), (3, '{ok,happy}', ROW(ROW(2, 'b', 'ok'), 0, '{}'))",
    "DELETE FROM keyless WHERE ctid = (SELECT min(ctid) FROM keyless WHERE a = 1)",
    "UPDATE keyless SET moods = '{happy}' WHERE ctid = (SELECT min(ctid) FROM keyless WHERE a = 1)",
]
TABLES = {"public.matrix": None, "public.keyless": None}


def _as_postgres_text(pg_type: PgType) -> PgType:
    """Render a value as PostgreSQL's text: an array as its array literal (the oracle's ``::text``)."""
    def to_json(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray)):
            return "\\x" + bytes(value).hex()
        if isinstance(value, bool):
            return "t" if value else "f"
        rendered = pg_type.to_json(value)
        return array_literal(rendered) if isinstance(rendered, list) else rendered

    return dataclasses.replace(pg_type, to_json=to_json)


def _truth(conn: psycopg.Connection, table: str) -> tuple[list[str], list[tuple[str | None, ...]], dict[str, PgType]]:
    columns = [r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
        "ORDER BY attnum", (table,)).fetchall()]
    # format('%s') calls each type's output function, as pgoutput's text mode does; a composite of
    # NULL fields IS NULL, though the value is not: its text is NULL only for a NULL value
    select = ", ".join(f"CASE WHEN {c}::text IS NOT NULL THEN format('%s', {c}) END" for c in columns)
    rows = sorted((tuple(r) for r in conn.execute(f"SELECT {select} FROM {table}").fetchall()), key=repr)
    types = {name: _as_postgres_text(pg_type) for name, pg_type in source_types(conn, table).items()}
    return columns, rows, types


@pytest.mark.spark
@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_the_type_matrix_copied_then_streamed_equals_postgres_with_one_schema(any_db, spark, tmp_path,
                                                                             binary: bool) -> None:  # type: ignore[no-untyped-def]
    from cdc_apply.pipeline import drain

    server, dbname = any_db
    conninfo = server.conninfo(dbname)

    def config(pipeline: str, snapshot: bool):  # type: ignore[no-untyped-def]
        return parse_config({"pipeline": pipeline, "source": {"dsn": conninfo, "slot": pipeline, "publication": "pub",
                                                              "binary": binary},
                             "target": {"warehouse": str(tmp_path / pipeline)}, "snapshot": {"enabled": snapshot}})

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SCHEMA)
        create_slot(conn, "streamed")  # sees every row as a change: the stream's mapping alone
        for statement in BEFORE:
            conn.execute(statement)
    drain(config("copied", True), spark)  # creates its slot, then copies the rows
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for statement in AFTER:
            conn.execute(statement)
        truth = {table: _truth(conn, table) for table in TABLES}
    drain(config("copied", True), spark)
    drain(config("streamed", False), spark)

    schemas = {}
    for pipeline in ("copied", "streamed"):
        for table, (columns, rows, types) in truth.items():
            path = str(tmp_path / pipeline / table.replace(".", "/"))
            got = delta_rows(spark, path, columns, types)
            assert got == rows, (f"{pipeline} {table}: only in Delta {[r for r in got if r not in rows][:2]}, "
                                 f"only in PostgreSQL {[r for r in rows if r not in got][:2]}")
            frame = spark.read.format("delta").load(path)
            schemas[pipeline, table] = {f.name: f.dataType.simpleString() for f in frame.schema.fields
                                        if f.name in columns}
    for table in TABLES:
        assert schemas["copied", table] == schemas["streamed", table], table
    matrix = schemas["copied", "public.matrix"]
    assert matrix["c_moods"] == matrix["c_inners"] == matrix["c_multis"] == "array<string>"
    assert matrix["c_multi"] == matrix["c_small"] == matrix["c_list"] == matrix["c_outer"] == "string"

    # format("pgoutput") on the live slot, typed by the table's Relation: the same types.
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_slot(conn, "read")
        conn.execute("UPDATE matrix SET c_i2 = 2 WHERE id = 1")
    frame = (spark.read.format("pgoutput").option("dsn", conninfo).option("slot", "read").option("publication", "pub")
             .option("binary", str(binary).lower()).option("table", "public.matrix").load())
    new = frame.schema["new"].dataType
    assert {f.name: f.dataType.simpleString() for f in new.fields} == matrix
    (row,) = frame.select("new.c_moods", "new.c_i2", "new.c_outer").collect()  # (a BC date: no Python date)
    assert row["c_moods"] == ["happy"] and row["c_i2"] == 2 and row["c_outer"] == '("(1,""x y"",sad)",2.5,"{a,""b c""}")'

