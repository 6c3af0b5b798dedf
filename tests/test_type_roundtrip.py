"""Every type family: the value inserted in PostgreSQL equals the value decoded, in text and binary mode.

Two independent checks per value: the binary converter agrees with the text converter, and the
decoded value renders back to exactly PostgreSQL's own text output of the stored value.
"""

from __future__ import annotations

import math
import struct
from decimal import Decimal

import psycopg
import pytest

from cdc_apply.assemble import Assembler
from cdc_apply.transactions import Change, Transaction
from cdc_apply.changerows.columns import InsertedRows, inserted_images
from cdc_apply.changerows.segments import ChangeRowBuilder, change_rows
from cdc_apply.pgtypes import UnrepresentableValueError, lookup
from cdc_apply.pgtypes.datetime import (
    DATE_NEG_INFINITY, DATE_POS_INFINITY, TIMESTAMP_POS_INFINITY, date_from_text,
)
from cdc_apply.sources.copy_text import parse_copy_text
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes
from tests.rows_compare import assert_columnar_matches_scalar, normalised

# column type -> literals (each becomes one row); rendered == PostgreSQL's text unless noted
MATRIX: dict[str, list[str]] = {
    "bool": ["true", "false"],
    "int2": ["-32768", "32767"],
    "int4": ["-2147483648", "2147483647"],
    "int8": ["-9223372036854775808", "9223372036854775807"],
    "oid": ["4294967295", "0"],
    "float4": ["1.5", "'NaN'", "'Infinity'", "'-Infinity'", "'-0'", "3.4e38"],
    "float8": ["1.25e-300", "'NaN'", "'-Infinity'", "'-0'", "0.1"],
    "numeric": ["0", "'NaN'", "'Infinity'", "'-Infinity'", "123456789012345678901234567890.000000000001",
                "-0.000001", "1e-20", "10000", "99990000"],
    "numeric(12,2)": ["0", "-12.34", "9999999999.99", "0.01"],
    "numeric(38,10)": ["1234567890123456789012345678.0123456789"],
    "money": ["12.34", "-1234567.89", "0"],
    "text": ["''", "'héllo wörld ✓'", "E'tab\\there'"],
    "varchar(5)": ["'abc'"],
    "char(4)": ["'ab'"],
    "name": ["'a_name'"],
    "bytea": ["'\\x00ff10'::bytea", "''::bytea"],
    "date": ["'2024-02-29'", "'0044-03-15 BC'", "'infinity'", "'-infinity'", "'9999-12-31'", "'20000-01-01'",
             "'1970-01-01'", "'1969-12-31'"],
    "time": ["'00:00:00'", "'23:59:59.999999'", "'12:30:00.5'", "'24:00:00'"],
    "timetz": ["'12:00:00+05:30'", "'00:00:01.25-08'"],
    "timestamp": ["'2024-02-29 12:34:56.789'", "'0044-03-15 10:00:00 BC'", "'infinity'", "'-infinity'",
                  "'1969-12-31 23:59:59.999999'"],
    "timestamptz": ["'2024-02-29 12:34:56.789+02'", "'infinity'", "'0100-01-01 00:00:00+00 BC'"],
    "interval": ["'1 year 2 months 3 days 04:05:06.789'", "'-1 days +02:00:00'", "'0'", "'-00:00:01'",
                 "'100 years -5 mons'"],
    "uuid": ["'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'"],
    "json": ["'{\"a\": [1, 2]}'"],
    "jsonb": ["'{\"b\": 1, \"a\": [true, null]}'"],
    "inet": ["'192.168.0.1'", "'10.0.0.0/8'", "'::1'", "'2001:db8::1/64'", "'::ffff:1.2.3.4'"],
    "cidr": ["'10.0.0.0/8'", "'2001:db8::/32'"],
    "macaddr": ["'08:00:2b:01:02:03'"],
    "macaddr8": ["'08:00:2b:01:02:03:04:05'"],
    "bit(5)": ["B'10101'"],
    "varbit": ["B'1'", "B''", "B'1010101010101'"],
    "int4range": ["'[1,10)'", "'empty'", "'(,5]'"],
    "numrange": ["'[1.5,2.5]'"],
    "daterange": ["'[2024-01-01,2024-02-01)'"],
    "tstzrange": ["'[2024-01-01 00:00:00+00,)'"],
    "int4multirange": ["'{[1,3),[5,7)}'", "'{}'"],
    "int8multirange": ["'{[1,2), [10,)}'"],
    "nummultirange": ["'{[1.5,2.5], (3,)}'"],
    "datemultirange": ["'{[2024-01-01,2024-02-01)}'"],
    "tsmultirange": ["'{[2024-01-01 00:00:00,2024-01-02 00:00:00)}'"],
    "tstzmultirange": ["'{[2024-01-01 00:00:00+00,)}'"],
    "pg_lsn": ["'16/B374D848'", "'0/0'", "'FFFFFFFF/FFFFFFFF'"],
    "xid8": ["'18446744073709551615'", "'0'"],
    "tid": ["'(4294967295,65535)'", "'(0,1)'"],
    "cid": ["'4294967295'"],
    "int4[]": ["'{1,NULL,3}'", "'{{1,2},{3,4}}'", "'{}'"],
    "text[]": [r"""'{"a b",NULL,"c,d","e\"f"}'"""],
    "numeric[]": ["'{1.5,NaN}'"],
    "date[]": ["'{2024-01-01,infinity}'"],
    "timestamptz[]": ["ARRAY['2024-01-01 00:00:00+00'::timestamptz]"],
    "mood": ["'happy'"],
    "mood[]": ["'{sad,ok}'"],
}


def _rendered(pg_type_name: str, value: object, to_json) -> str | None:  # type: ignore[no-untyped-def]
    if value is None:
        return None
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    rendered = to_json(value)
    if isinstance(rendered, bool):
        return "t" if rendered else "f"
    return str(rendered)


def _same_float(pg_text: str, value: float, single: bool) -> bool:
    expected = float(pg_text)
    if single:
        expected = struct.unpack("!f", struct.pack("!f", expected))[0]
    if math.isnan(expected):
        return math.isnan(value)
    return expected == value and math.copysign(1, expected) == math.copysign(1, value)


@pytest.fixture(scope="module")
def captured(pg_server):  # type: ignore[no-untyped-def]
    from tests.conftest import fresh_database

    for server, dbname in fresh_database(pg_server):
        yield _capture(server, dbname)


def _capture(server, dbname):  # type: ignore[no-untyped-def]
    columns = {f"c{i}": type_name for i, type_name in enumerate(MATRIX)}
    rows = max(len(v) for v in MATRIX.values())
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
        ddl = ", ".join(f"{name} {type_name}" for name, type_name in columns.items())
        conn.execute(f"CREATE TABLE typed (id int PRIMARY KEY, {ddl})")
        conn.execute("CREATE PUBLICATION pub FOR TABLE typed")
        create_slot(conn, "types")
        for row in range(rows):
            names = ", ".join(name for name, t in columns.items() if row < len(MATRIX[t]))
            values = ", ".join(f"({MATRIX[t][row]})::{t}" for t in columns.values() if row < len(MATRIX[t]))
            conn.execute(f"INSERT INTO typed (id, {names}) VALUES ({row}, {values})")
        # format('%s') calls each type's output function, as pgoutput's text mode does (::text may not)
        select = ", ".join(f"CASE WHEN {name} IS NOT NULL THEN format('%s', {name}) END" for name in columns)
        truth = {r[0]: r[1:] for r in conn.execute(f"SELECT id, {select} FROM typed").fetchall()}
        decoded = {}
        captures = {}
        for binary in (False, True):
            raws = captures[binary] = list(read_changes(conn, "types", PgOutputOptions(("pub",), binary=binary)))
            segments = change_rows(Assembler().transactions(raws))
            decoded[binary] = {r["new"]["id"]: r["new"] for seg in segments for r in seg.rows}
        # The table as the snapshot copies it: COPY text, UTF-8 (sources/exported_snapshot.py).
        conn.execute("SET client_encoding TO 'UTF8'")
        with conn.cursor().copy(f"COPY (SELECT id, {', '.join(columns)} FROM typed ORDER BY id) TO STDOUT") as copy:
            copied = b"".join(bytes(data) for data in copy)
    return columns, truth, decoded, captures, copied


def test_columnar_conversion_equals_the_scalar_one_for_every_type(captured) -> None:  # type: ignore[no-untyped-def]
    columns, _, _, captures, _ = captured
    for binary, raws in captures.items():
        transactions = list(Assembler().transactions(raws))
        # The row holding a multi-dimensional array cannot be Arrow (docs/apply.md): compare the others.
        flat = [t for t in transactions
                if not any(isinstance(v, list) and any(isinstance(e, list) for e in v)
                           for s in change_rows([t]) for r in s.scalar_rows() for v in r["new"].values())]
        assert 0 < len(transactions) - len(flat) <= 1
        segments = change_rows(flat)
        assert segments and all(s.from_stream for s in segments)
        for segment in segments:
            assert_columnar_matches_scalar(segment, f"binary={binary}")
            assert segment.to_arrow().num_rows == len(flat)


def test_snapshot_chunks_convert_a_column_at_a_time_like_the_stream(captured) -> None:  # type: ignore[no-untyped-def]
    """A snapshot chunk's rows (PostgreSQL's COPY text, parsed into spans: ``sources/copy_text.py``)
    take the column-at-a-time conversion, equal to the scalar one, and decode to what the text
    stream decoded."""
    columns, truth, decoded, captures, copied = captured
    first = next(iter(Assembler().transactions(captures[False])))
    relation = first.changes[0].relation
    assert [c.name for c in relation.columns] == ["id", *columns]
    rows = parse_copy_text(copied, len(relation.columns), lambda row: f"row {row}")
    assert len(rows) == len(truth)
    # The COPY values are PostgreSQL's text output, as the stream's text mode sends them.
    assert [[rows.text(r, c) for c in range(1, len(relation.columns))] for r in range(len(rows))] == \
        [list(values) for _, values in sorted(truth.items())]
    changes = [Change(seq, "I", relation) for seq in range(len(rows))]
    chunk = InsertedRows(inserted_images(rows.buf, rows.is_null, rows.starts, rows.lengths))
    # The stream's Type messages name the enum; without them an enum[] value stays text (both paths alike).
    (segment,) = ChangeRowBuilder().build([Transaction(0, 100, 100, 0, changes, kind="snapshot", types=first.types)],
                                          chunk)
    assert segment.columnar and not segment.from_stream
    assert_columnar_matches_scalar(segment, "snapshot")
    flat = [r for r in segment.scalar_rows()
            if not any(isinstance(v, list) and any(isinstance(e, list) for e in v) for v in r["new"].values())]
    assert len(flat) == len(truth) - 1  # the row with the multi-dimensional array
    assert normalised([r["new"] for r in flat]) == normalised([decoded[False][r["new"]["id"]] for r in flat])


def test_binary_and_text_decode_to_the_same_values(captured) -> None:  # type: ignore[no-untyped-def]
    columns, truth, decoded, _, _ = captured
    assert decoded[False].keys() == truth.keys()
    for row_id, text_row in decoded[False].items():
        binary_row = decoded[True][row_id]
        for name in columns:
            left, right = text_row[name], binary_row[name]
            if isinstance(left, float) and math.isnan(left):
                assert isinstance(right, float) and math.isnan(right), name
            else:
                assert left == right, f"row {row_id} {columns[name]}: text {left!r} != binary {right!r}"


def test_decoded_values_render_back_to_postgres_text(captured) -> None:  # type: ignore[no-untyped-def]
    columns, truth, decoded, _, _ = captured
    special = {"float4", "float8", "money", "interval", "numeric[]"}
    checked = 0
    for binary in (False, True):
        for row_id, pg_values in truth.items():
            row = decoded[binary][row_id]
            for (name, type_name), pg_text in zip(columns.items(), pg_values, strict=True):
                value = row[name]
                if pg_text is None:
                    assert value is None
                    continue
                if type_name in ("float4", "float8"):
                    assert _same_float(pg_text, value, type_name == "float4"), (type_name, pg_text, value)
                elif type_name not in special:
                    to_json = _to_json_for(type_name)
                    assert _rendered(type_name, value, to_json) == _pg_equivalent(type_name, pg_text), \
                        f"{type_name} binary={binary}: {value!r} vs PostgreSQL {pg_text!r}"
                checked += 1
    assert checked > 150


def _to_json_for(type_name: str):  # type: ignore[no-untyped-def]
    base = type_name.split("(")[0]
    aliases = {"varchar": "varchar", "char": "bpchar", "bit": "bit", "mood": "text", "mood[]": None}
    if base in aliases and aliases[base] is None:
        return lambda v: "{" + ",".join(v) + "}"
    if base.endswith("[]"):
        element = lookup({"int4[]": 1007, "text[]": 1009, "date[]": 1182, "timestamptz[]": 1185}[base])
        return lambda v: _pg_array_text(element.to_json(v))
    pg_type = lookup({"bpchar": 1042}.get(aliases.get(base, base), 0)) or _by_name(aliases.get(base, base))
    return pg_type.to_json


def _by_name(name: str):  # type: ignore[no-untyped-def]
    from cdc_apply.pgtypes.registry import lookup_name

    found = lookup_name(name)
    assert found is not None, name
    return found


def _pg_array_text(value: object) -> str:
    if isinstance(value, list):
        return "{" + ",".join(_pg_array_text(v) for v in value) + "}"
    if value is None:
        return "NULL"
    text = str(value)
    if any(c in text for c in ' ,{}"\\') or text == "":
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _pg_equivalent(type_name: str, pg_text: str) -> str:
    return pg_text


def test_special_values_follow_their_documented_rule(captured) -> None:  # type: ignore[no-untyped-def]
    columns, truth, decoded, _, _ = captured
    by_type = {type_name: name for name, type_name in columns.items()}
    for binary in (False, True):
        rows = decoded[binary]
        date = by_type["date"]
        assert rows[2][date] == DATE_POS_INFINITY and rows[3][date] == DATE_NEG_INFINITY
        assert rows[1][date] == date_from_text("0044-03-15 BC") == -735_160
        assert rows[2][by_type["timestamp"]] == TIMESTAMP_POS_INFINITY
        assert rows[1][by_type["numeric"]] == "NaN"  # unbounded numeric travels as exact text
        assert rows[1][by_type["numeric(12,2)"]] == Decimal("-12.34")
        assert rows[1][by_type["money"]] == Decimal("-1234567.89")
        assert rows[0][by_type["interval"]] == {"months": 14, "days": 3, "microseconds": 14_706_789_000}
        assert rows[1][by_type["interval"]] == {"months": 0, "days": -1, "microseconds": 7_200_000_000}
        assert rows[4][by_type["interval"]] == {"months": 1195, "days": 0, "microseconds": 0}
        assert rows[1][by_type["int4[]"]] == [[1, 2], [3, 4]]
        assert rows[0][by_type["int4[]"]] == [1, None, 3]
        assert rows[0][by_type["text[]"]] == ["a b", None, "c,d", 'e"f']
        assert rows[0][by_type["numeric[]"]] == ["1.5", "NaN"]
        assert rows[0][by_type["bytea"]] == b"\x00\xff\x10"
        assert rows[0][by_type["mood[]"]] == ["sad", "ok"]


def test_bounded_numeric_cannot_silently_take_nan() -> None:
    numeric = lookup(1700)
    assert numeric is not None
    typmod = ((12 << 16) | 2) + 4
    with pytest.raises(UnrepresentableValueError):
        numeric.from_text("NaN", typmod)
    assert numeric.spark_type(typmod) == "decimal(12,2)" and numeric.spark_type(-1) == "string"


@pytest.mark.spark
def test_the_data_source_reads_a_binary_capture_as_postgres_text(captured, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A capture recorded with ``binary = true``, read by ``spark.read.format("pgoutput")``: each
    binary value reaches the text maps as PostgreSQL's text, which converts back to exactly the value
    the binary converter decodes, for every type of the matrix."""
    from cdc_apply.pgoutput import messages as m
    from cdc_apply.sources.capture import write_jsonl

    columns, _, decoded, captures, _ = captured
    path = tmp_path / "binary.jsonl"
    write_jsonl(path, captures[True])
    codec = change_rows(Assembler().transactions(captures[False]))[0].codec
    by_name = {column.name: column for column in codec.columns}
    rows = spark.read.format("pgoutput").load(str(path)).where("op = 'I'").select("new").collect()
    assert len(rows) == len(decoded[True])
    wrong = []
    for row in rows:
        new = row.new
        expected = decoded[True][int(new["id"])]
        for name in columns:
            text = new.get(name)
            value = None if text is None else by_name[name].convert(m.KIND_TEXT, text.encode())
            want = expected[name]
            same = isinstance(value, float) and math.isnan(value) if isinstance(want, float) and math.isnan(want) \
                else value == want
            if not same:
                wrong.append(f"row {new['id']} {columns[name]}: {text!r} decodes to {value!r}, not {want!r}")
    assert not wrong, "\n".join(wrong)


def test_every_built_in_type_with_a_binary_form_is_decoded_or_refused_by_name(pg_server) -> None:  # type: ignore[no-untyped-def]
    """The live server's built-in types with a binary send function: each has a binary decoder, or is in
    the documented refusal list, whose error names the type and the remedy (docs/types.md)."""
    from cdc_apply.pgtypes import TypeCache, ValueConversionError
    from cdc_apply.pgtypes.system import WITHOUT_BINARY_DECODER

    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        sent = conn.execute("SELECT oid, typname FROM pg_type WHERE oid < 10000 AND typsend <> 0 AND typtype <> 'p' "
                            "ORDER BY oid").fetchall()
    assert len(sent) > 150
    types = TypeCache()
    decoded = [oid for oid, _ in sent if lookup(oid) is not None]
    assert {4451, 4532, 4533, 4534, 4535, 4536, 6150, 3220, 5069} <= set(decoded)  # multiranges, pg_lsn, xid8
    for oid, name in sent:
        if oid in decoded:
            continue
        assert WITHOUT_BINARY_DECODER.get(oid) == name, f"{name} (OID {oid}): neither decoded nor refused by name"
        with pytest.raises(ValueConversionError) as refused:
            types.get(oid).from_binary(b"\x00\x00\x00\x01", -1)
        assert f"type {name} (OID {oid})" in str(refused.value) and "source.binary: false" in str(refused.value)
        assert "capture" not in str(refused.value)
