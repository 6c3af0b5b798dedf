"""User-defined types in binary mode (docs/types.md, "User-defined types"): domains (over int4, text,
numeric(10,2), and over a domain), an enum and an array of enums, a composite holding a composite,
a NULL field and an array, and an array of composites.

Oracles: every decoded value equals PostgreSQL's own text of it, in both modes, on both server
versions; live and from a capture, the Delta table equals the PostgreSQL table (read by Spark and by
delta-rs) and equals the same workload applied in text mode, schema included.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_apply.assemble import Assembler
from cdc_apply.changerows.segments import change_rows
from cdc_apply.config import parse_config
from cdc_apply.errors import CdcApplyError
from cdc_apply.pgtypes import TypeCache, ValueConversionError
from cdc_apply.pgtypes.user import UserType, binary_text, facts_json, parse_facts
from cdc_apply.sources.capture import read_capture, with_type_facts, write_jsonl
from cdc_apply.sources.catalog import SourceCatalog, read_type_facts
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes, server_version_num
from tests.capture_helpers import peek
from tests.test_decode_cli import _cli

SCHEMA = """
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN smallpos AS posint CHECK (VALUE < 1000);
CREATE DOMAIN email AS text CHECK (VALUE LIKE '%@%');
CREATE DOMAIN price AS numeric(10,2);
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TYPE inner_t AS (a int4, gone int4, b text, m mood);
ALTER TYPE inner_t DROP ATTRIBUTE gone;
CREATE TYPE outer_t AS (i inner_t, n numeric, tags text[], p posint, note text);
CREATE TABLE user_types (id int PRIMARY KEY, c_posint posint, c_small smallpos, c_email email, c_price price,
                         c_mood mood, c_moods mood[], c_outer outer_t, c_inners inner_t[]);
"""
COLUMNS = ["c_posint", "c_small", "c_email", "c_price", "c_mood", "c_moods", "c_outer", "c_inners"]
ARRAYS = {"c_moods", "c_inners"}

WORKLOAD = [
    "INSERT INTO user_types VALUES (1, 7, 12, 'a@b.c', 12.5, 'ok', '{sad,happy}', "
    "ROW(ROW(1, 'x y', 'sad')::inner_t, 3.14, '{a,\"b c\"}', 5, NULL)::outer_t, "
    "ARRAY[ROW(1, 'one', 'ok')::inner_t, ROW(NULL, NULL, NULL)::inner_t])",
    "INSERT INTO user_types VALUES (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
    "INSERT INTO user_types VALUES (3, 2147483647, 999, 'q\"uote\\\\back@x', -99999999.99, 'happy', '{}', "
    "ROW(NULL, NULL, '{}', NULL, '')::outer_t, '{}')",
    "INSERT INTO user_types VALUES (4, 1, 1, 'p(a)r,en@s', 0, 'sad', ARRAY['ok', NULL]::mood[], "
    "ROW(ROW(-1, '', 'happy')::inner_t, 'NaN', ARRAY[NULL, 'x,y', '']::text[], 1, 'a\"b\\\\c (d), e')::outer_t, "
    "ARRAY[NULL, ROW(2, 'two, \"2\"', NULL)::inner_t])",
    "UPDATE user_types SET c_posint = 8, c_mood = 'happy', c_outer.note = 'changed' WHERE id = 1",
    "UPDATE user_types SET c_inners = ARRAY[ROW(9, 'nine', 'sad')::inner_t] WHERE id = 2",
    "DELETE FROM user_types WHERE id = 3",
]


def _create(conn: psycopg.Connection, *slots: str) -> None:
    conn.execute(SCHEMA)
    conn.execute("CREATE PUBLICATION pub FOR TABLE user_types")
    for slot in slots:
        create_slot(conn, slot)
    for statement in WORKLOAD:
        conn.execute(statement)


def postgres_values(conn: psycopg.Connection) -> dict[int, tuple[Any, ...]]:
    """PostgreSQL's text of every value (an array of a user-defined type as the text of each element)."""
    select = ", ".join(f"{c}::text[]" if c in ARRAYS else f"{c}::text" for c in COLUMNS)
    return {row[0]: tuple(row[1:]) for row in conn.execute(f"SELECT id, {select} FROM user_types").fetchall()}


def _decoded(raws: list, type_facts=None) -> dict[int, tuple[Any, ...]]:  # type: ignore[no-untyped-def]
    rows: dict[int, tuple[Any, ...]] = {}
    for segment in change_rows(Assembler(type_facts=type_facts).transactions(raws)):
        for row in segment.rows:
            if row["op"] == "D":
                rows.pop(row["key"]["id"])
            else:
                rows[row["new"]["id"]] = tuple(row["new"][c] for c in COLUMNS)
    return rows


def test_binary_values_of_user_defined_types_decode_to_postgres_text(any_db, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Live (the assembler asks the catalog) and from a capture's recorded facts, binary decodes to
    exactly the text mode's values, and both to PostgreSQL's text, for every kind and depth."""
    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _create(conn, "user_types")
        truth = postgres_values(conn)
        text = peek(server, dbname, "user_types", PgOutputOptions(("pub",), binary=False))
        binary = peek(server, dbname, "user_types", PgOutputOptions(("pub",), binary=True))
        recorded = list(with_type_facts(peek(server, dbname, "user_types", PgOutputOptions(("pub",), binary=True)),
                                        lambda oid: read_type_facts(conn, oid)))
        # Protocol 2 and 4, every transaction streamed (Type messages then carry the xid, in stream blocks).
        newest = server_version_num(conn) >= 160000
        streamed = list(with_type_facts(
            peek(server, dbname, "user_types", PgOutputOptions(("pub",), proto_version=4 if newest else 2, binary=True,
                                                               streaming="parallel" if newest else "on"),
                 immediate_streaming=newest),
            lambda oid: read_type_facts(conn, oid)))
    assert _decoded(text) == truth
    assert _decoded(streamed) == truth
    assert _decoded(binary, SourceCatalog(conninfo).type_facts) == truth
    assert _decoded(recorded) == truth
    facts = [raw.type_facts for raw in recorded if raw.type_facts]
    assert len(facts) == 8, facts  # one Type message per user-defined column type
    # A binary capture without the facts reads what the wire describes (domains over built-in types,
    # enums, enum arrays) and names the first value that needs the catalog: a composite holding a
    # composite, whose field the wire names only by its OID.
    with pytest.raises(CdcApplyError, match=r"LSN .* column 'c_outer' .*type OID \d+ is neither built in .*"
                                            r"cdc-apply capture .*source.binary: false"):
        _decoded(binary)

    # A capture whose recorded facts disagree with its values: the CLI names the file, LSN and column.
    tampered = tmp_path / "tampered.jsonl"
    for raw in recorded:
        if raw.type_facts and '["n",1700]' in raw.type_facts:
            raw.type_facts = raw.type_facts.replace('["n",1700]', '["n",23]')
    write_jsonl(tampered, recorded)
    result = _cli("decode", "--changes", str(tampered))
    assert result.returncode == 1
    assert "LSN" in result.stderr and "column 'c_outer'" in result.stderr
    assert "outer_t.n: binary field has type OID 1700, the catalog gives 23" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_capture_keeps_the_facts_on_the_type_message_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cdc_apply.sources.raw import RawMessage
    from cdc_apply.sources.capture import write_parquet

    facts = facts_json([UserType(16384, "public.posint", "domain", base=23)])
    rows = [RawMessage(0x10, None, b"Y\x00\x00\x40\x00public\x00posint\x00", type_facts=facts),
            RawMessage(0x11, None, b"B" + bytes(20))]
    for name, writer in (("c.jsonl", write_jsonl), ("c.parquet", write_parquet)):
        writer(tmp_path / name, rows)
        assert [r.type_facts for r in read_capture(tmp_path / name)] == [facts, None]


def _facts() -> dict[int, UserType]:
    return dict(parse_facts(facts_json([
        UserType(900001, "public.inner_t", "composite", fields=(("a", 23), ("b", 25))),
        UserType(900002, "public.posint", "domain", base=23),
        UserType(900003, "public.loop", "domain", base=900003)])))


def _record(*fields: tuple[int, bytes | None], count: int | None = None) -> bytes:
    out = struct.pack("!i", len(fields) if count is None else count)
    for oid, value in fields:
        out += struct.pack("!Ii", oid, -1 if value is None else len(value)) + (value or b"")
    return out


GOOD = _record((23, struct.pack("!i", 5)), (25, b"a b"))


@pytest.mark.parametrize("raw,error", [
    (_record((23, struct.pack("!i", 5))), "has 1 fields, the catalog gives 2"),
    (_record((23, struct.pack("!i", 5)), (23, b"abcd")), r"inner_t.b: binary field has type OID 23, the catalog gives 25"),
    (GOOD[:-1], "runs past"),
    (GOOD + b"x", "bytes after the last field"),
    (GOOD[:10], "truncated"),
])
def test_a_hostile_composite_is_a_clear_error(raw: bytes, error: str) -> None:
    facts = _facts()
    assert binary_text(900001, GOOD, facts, 0) == '(5,"a b")'
    with pytest.raises(ValueConversionError, match=error):
        binary_text(900001, raw, facts, 0)


def test_a_domain_over_itself_is_refused_not_recursed_forever() -> None:
    with pytest.raises(ValueConversionError, match="nested deeper"):
        binary_text(900003, b"\x00\x00\x00\x01", _facts(), 0)


def test_a_capture_with_malformed_facts_fails_naming_its_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cdc_apply.errors import CaptureError

    capture = tmp_path / "bad.jsonl"
    capture.write_text('{"lsn": "0/10", "xid": null, "data": "42", "type_facts": "[{\\"oid\\": -1}]"}\n')
    with pytest.raises(CaptureError, match=r"bad.jsonl:1: not a capture line .*malformed type facts"):
        list(read_capture(capture))


def test_malformed_facts_are_a_clear_error() -> None:
    for text in ("{", "[1]", '[{"oid": -1, "name": "x", "kind": "enum"}]', '[{"oid": 1, "name": "x", "kind": "range"}]'):
        with pytest.raises(ValueConversionError, match="malformed type facts"):
            TypeCache().add(1, "public", "x", text)


def test_random_damage_to_composite_values_never_escapes_as_another_error() -> None:
    """The fuzz: any byte flipped, cut or added gives a value or a ValueConversionError."""
    facts = _facts()
    nested = UserType(900004, "public.outer_t", "composite", fields=(("i", 900001), ("t", 1009), ("p", 900002)))
    facts[nested.oid] = nested
    value = _record((900001, GOOD), (1009, bytes.fromhex("0000000100000000000000190000000200000001"
                                                         "00000001610000000162")), (900002, struct.pack("!i", 3)))
    assert binary_text(nested.oid, value, facts, 0) == '("(5,""a b"")","{a,b}",3)'
    rng = random.Random(57)
    for _ in range(3000):
        damaged = bytearray(value)
        action = rng.randrange(3)
        if action == 0:
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        elif action == 1:
            del damaged[rng.randrange(len(damaged)):]
        else:
            damaged[rng.randrange(len(damaged)):rng.randrange(len(damaged))] = rng.randbytes(rng.randrange(1, 9))
        try:
            binary_text(nested.oid, bytes(damaged), facts, 0)
        except ValueConversionError:
            pass


# -- Delta oracles ----------------------------------------------------------------------------------


def test_a_binary_capture_without_facts_decodes_what_the_wire_describes(any_db) -> None:  # type: ignore[no-untyped-def]
    """No catalog facts (a capture made by pg_logical_slot_get_binary_changes or another tool): a domain
    over a built-in type (named by its base in the Type message), domains over domains, an enum and an
    array of it, a composite of built-in fields and an array of such composites, all equal to
    PostgreSQL's text."""
    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("""
            CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
            CREATE DOMAIN smallpos AS posint CHECK (VALUE < 1000);
            CREATE DOMAIN price AS numeric(10,2);
            CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
            CREATE TYPE pair AS (a int4, gone int4, b text, c numeric, d date[]);
            ALTER TYPE pair DROP ATTRIBUTE gone;
            CREATE TABLE wire (id int PRIMARY KEY, p posint, s smallpos, pr price, m mood, ms mood[], c pair,
                               cs pair[]);
            CREATE PUBLICATION pub FOR TABLE wire""")
        create_slot(conn, "wire")
        conn.execute("""INSERT INTO wire VALUES
            (1, 7, 12, 12.5, 'ok', '{sad,NULL,happy}', ROW(1, 'x y', 3.14, '{2024-01-01,NULL}'),
             ARRAY[ROW(2, '', NULL, '{}')::pair, NULL, ROW(NULL, 'a"b\\c', -1, NULL)::pair]),
            (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL)""")
        conn.execute("UPDATE wire SET c.b = 'changed', m = 'happy' WHERE id = 1")
        columns = ["p", "s", "pr", "m", "ms", "c", "cs"]
        select = ", ".join(f"{c}::text[]" if c in ("ms", "cs") else f"{c}::text" for c in columns)
        truth = {row[0]: tuple(row[1:]) for row in conn.execute(f"SELECT id, {select} FROM wire").fetchall()}
        raws = list(read_changes(conn, "wire", PgOutputOptions(("pub",), binary=True)))
    assert not any(raw.type_facts for raw in raws)
    decoded: dict[int, tuple[Any, ...]] = {}
    for segment in change_rows(Assembler().transactions(raws)):
        for row in segment.rows:
            decoded[row["new"]["id"]] = tuple(row["new"][c] for c in columns)
    assert decoded == truth


def _delta_values(spark, path: str) -> tuple[dict[int, tuple[Any, ...]], str]:  # type: ignore[no-untyped-def]
    """The table read by Spark; delta-rs must read the same. Also its schema, as Spark gives it."""
    frame = spark.read.format("delta").load(path)
    by_spark = {row["id"]: tuple(row[c] for c in COLUMNS) for row in frame.collect()}
    table = pa.RecordBatchReader.from_stream(DeltaTable(path).scan()).read_all()
    by_delta_rs = {row["id"]: tuple(row[c] for c in COLUMNS) for row in table.to_pylist()}
    assert by_delta_rs == by_spark
    return by_spark, frame.select(["id", *COLUMNS]).schema.simpleString()


@pytest.mark.spark
def test_binary_mode_applies_user_defined_types_like_text_mode_live_and_from_a_capture(any_db, spark,
                                                                                         tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cdc_apply.apply.options import apply_options
    from cdc_apply.pipeline import capture, drain
    from cdc_apply.replay import replay

    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _create(conn, "text_mode", "binary_mode", "captured")
        truth = postgres_values(conn)

    def config(slot: str, binary: bool):  # type: ignore[no-untyped-def]
        return parse_config({"pipeline": slot, "source": {"dsn": conninfo, "slot": slot, "publication": "pub",
                                                          "binary": binary},
                             "target": {"warehouse": str(tmp_path / slot)}, "snapshot": {"enabled": False}})

    for slot, binary in (("text_mode", False), ("binary_mode", True)):
        drain(config(slot, binary), spark)
    out = tmp_path / "captured.jsonl"
    capture(config("captured", True), str(out))
    assert sum(1 for line in out.read_text().splitlines() if "type_facts" in json.loads(line)) == 8
    replay(spark, [str(out)], apply_options(config("captured", True)))

    text_values, text_schema = _delta_values(spark, str(tmp_path / "text_mode" / "public" / "user_types"))
    assert text_values == truth
    for slot in ("binary_mode", "captured"):
        values, schema = _delta_values(spark, str(tmp_path / slot / "public" / "user_types"))
        assert values == truth, slot
        assert schema == text_schema, slot
    assert "c_inners:array<string>" in text_schema and "c_price:string" in text_schema

    # The data source, typed and binary: from the capture (its recorded facts) and from the slot (the catalog).
    from_capture = spark.read.format("pgoutput").option("table", "public.user_types").load(str(out))
    from_slot = (spark.read.format("pgoutput").option("dsn", conninfo).option("slot", "captured")
                 .option("publication", "pub").option("binary", "true").option("table", "public.user_types").load())
    for frame in (from_capture, from_slot):
        assert _final_state(frame.collect()) == truth


def _final_state(rows: list) -> dict[int, tuple[Any, ...]]:  # type: ignore[type-arg]
    state: dict[int, tuple[Any, ...]] = {}
    for row in sorted(rows, key=lambda r: (r["commit_lsn"], r["seq"])):
        if row["op"] == "D":
            state.pop(row["key"]["id"])
        else:
            state[row["new"]["id"]] = tuple(row["new"][c] for c in COLUMNS)
    return state


@pytest.mark.spark
@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_user_defined_types_copied_then_streamed_keep_one_type_per_column(any_db, spark, tmp_path,
                                                                        binary: bool) -> None:  # type: ignore[no-untyped-def]
    """The first `run --once` copies the rows that exist (the copy's mapping), the second streams the
    rest (the stream's): one schema, the one a stream-only run gives, and every value equal."""
    from cdc_apply.pipeline import drain

    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("CREATE PUBLICATION pub FOR TABLE user_types")
        for statement in WORKLOAD[:2]:  # before the slot: the copy's rows
            conn.execute(statement)

    def config(slot: str, snapshot: bool):  # type: ignore[no-untyped-def]
        return parse_config({"pipeline": slot, "source": {"dsn": conninfo, "slot": slot, "publication": "pub",
                                                          "binary": binary},
                             "target": {"warehouse": str(tmp_path / slot)}, "snapshot": {"enabled": snapshot}})

    drain(config("copied", True), spark)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_slot(conn, "streamed")
        conn.execute("TRUNCATE user_types")
        for statement in WORKLOAD:
            conn.execute(statement)
        truth = postgres_values(conn)
    drain(config("copied", True), spark)
    drain(config("streamed", False), spark)

    copied, copied_schema = _delta_values(spark, str(tmp_path / "copied" / "public" / "user_types"))
    streamed, streamed_schema = _delta_values(spark, str(tmp_path / "streamed" / "public" / "user_types"))
    assert streamed == truth, (streamed_schema, copied_schema)
    assert copied == truth, (copied, truth)
    assert copied_schema == streamed_schema
    assert "c_moods:array<string>" in copied_schema and "c_inners:array<string>" in copied_schema


@pytest.mark.spark
def test_a_target_copied_under_an_older_mapping_switches_to_text_or_is_refused_by_name(db18, spark, tmp_path,
                                                                                     monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A target whose enum-array and composite-array columns an older copy made ``string``, then
    streamed as ``array<string>``: under ``evolve`` the columns switch to PostgreSQL's text (values
    equal to PostgreSQL's); under ``ignore`` a clear error names the table, the column, both types, the
    LSN and the config key, and nothing of the batch is committed. Never a failed cast from Spark."""
    import cdc_apply.snapshot.copier as copier
    from cdc_apply.pipeline import drain

    server, dbname = db18
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("CREATE PUBLICATION pub FOR TABLE user_types")
        for statement in WORKLOAD[:2]:
            conn.execute(statement)

    def config(slot: str, policy: str):  # type: ignore[no-untyped-def]
        return parse_config({"pipeline": slot, "source": {"dsn": conninfo, "slot": slot, "publication": "pub"},
                             "target": {"warehouse": str(tmp_path / slot)}, "defaults": {"schema_policy": policy}})

    with monkeypatch.context() as older:  # the copy as it was: no Type message's names for the copy
        older.setattr(copier, "register_column_types", lambda *args: None)
        for policy in ("evolve", "ignore"):
            drain(config(policy, policy), spark)
    for policy in ("evolve", "ignore"):
        path = str(tmp_path / policy / "public" / "user_types")
        assert "c_moods:string" in _delta_values(spark, path)[1]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for statement in WORKLOAD[2:]:
            conn.execute(statement)
        as_text = {row[0]: tuple(row[1:]) for row in conn.execute(
            f"SELECT id, {', '.join(c + '::text' for c in COLUMNS)} FROM user_types").fetchall()}

    drain(config("evolve", "evolve"), spark)
    values, schema = _delta_values(spark, str(tmp_path / "evolve" / "public" / "user_types"))
    assert "c_moods:string" in schema and "c_inners:string" in schema
    assert values == as_text

    path = str(tmp_path / "ignore" / "public" / "user_types")
    before = DeltaTable(path).version()
    with pytest.raises(CdcApplyError) as refused:
        drain(config("ignore", "ignore"), spark)
    message = str(refused.value)
    assert message.startswith("public.user_types at LSN 0/"), message
    assert "column 'c_moods' is string in the target and array<string> in this batch" in message, message
    assert 'tables."public.user_types".columns."c_moods".type: string' in message, message
    assert DeltaTable(path).version() == before

