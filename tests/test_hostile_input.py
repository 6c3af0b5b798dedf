"""Hostile and careless input: every case ends in exit 1 or 2 with a located message, no traceback,
no signal, bounded memory, and nothing written outside the warehouse.

Most cases run ``cdc_apply.cli.main`` in this process (an uncaught exception fails the test, so a
traceback cannot pass); the ones that once crashed the process or blew up its memory run in a
subprocess under a memory limit.
"""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_apply.apply.options import ApplyOptions, TargetPathError, path_component
from cdc_apply.assemble import Assembler
from cdc_apply.changerows.segments import change_rows
from cdc_apply.errors import CdcApplyError
from cdc_apply.sources.capture import read_captures
from cdc_apply.sources.raw import RawMessage
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes
from tests import hostile as h
from tests.rows_compare import assert_columnar_matches_scalar
from tests.test_decode_cli import _cli_here

NUMERIC_10_2 = (10 << 16 | 2) + 4


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code, _, err = _cli_here(capsys, *argv)
    return code, err


def run_subprocess(*argv: str, memory_bytes: int = 2 * 1024**3, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return subprocess.run([sys.executable, "-m", "cdc_apply.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit)


# -- 1. paths -----------------------------------------------------------------------------------

def _decode_component(encoded: str) -> str:
    """The inverse of path_component: its existence is what makes the encoding injective."""
    if encoded == "~":
        return ""
    out = bytearray()
    i = 0
    while i < len(encoded):
        if encoded[i] == "~":
            out += bytes.fromhex(encoded[i + 1:i + 3])
            i += 3
        else:
            out += encoded[i].encode()
            i += 1
    return out.decode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=40))
def test_path_component_is_one_safe_component_and_injective(identifier: str) -> None:
    encoded = path_component(identifier)
    assert _decode_component(encoded) == identifier
    assert encoded not in (".", "..") and not encoded.startswith(".")
    assert "/" not in encoded and "\\" not in encoded and "\0" not in encoded
    assert encoded.isprintable()


@pytest.mark.parametrize("schema,table", [
    ("..", "escape"), ("/tmp/x", "t"), ("a/../..", "t"), ("public", ".."), ("public", "../../etc"), (".", "."),
    ("\\..\\", "t"), ("x\0y", "t"), (".hidden", "t"), ("~2E.", "t"), ("%2E.", "t"),
])
def test_every_identifier_lands_under_the_warehouse(tmp_path: Path, schema: str, table: str) -> None:
    warehouse = tmp_path / "wh"
    location, by_name = ApplyOptions(warehouse=str(warehouse)).default_target(schema, table)
    assert not by_name
    resolved = Path(location).resolve()
    assert resolved.is_relative_to(warehouse.resolve()) and resolved.parent.parent == warehouse.resolve()
    assert ApplyOptions(warehouse=str(warehouse)).default_target("..", "t") != \
        ApplyOptions(warehouse=str(warehouse)).default_target("~2E.", "t")


def test_plain_names_keep_their_paths(tmp_path: Path) -> None:
    options = ApplyOptions(warehouse=str(tmp_path))
    assert options.default_target("public", "order_items")[0] == str(tmp_path / "public" / "order_items")
    assert options.default_target("Sales", "t.v2")[0] == str(tmp_path / "Sales" / "t.v2")


def test_a_template_that_escapes_is_refused_at_validation_and_at_use(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for template in ("../../x/{schema}/{table}", "/etc/{table}", "{schema}/../../{table}", "..\\\\{table}",
                     "{table!r:>99999999}", "{table:>9}", "{schema.__class__}/{table}", "C:/{table}"):
        config = tmp_path / "c.yaml"
        config.write_text(json.dumps({"target": {"path_template": template}}))
        code, err = run_cli(capsys, "validate", str(config))
        assert code == 2, template
        assert f"{config}: target.path_template:" in err
    with pytest.raises(TargetPathError, match="not under the warehouse"):
        ApplyOptions(warehouse=str(tmp_path), path_template="../{table}").default_target("public", "t")


@pytest.mark.spark
def test_replay_of_real_hostile_schema_names_writes_only_under_the_warehouse(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cdc_apply.replay import replay
    from tests.delta_oracle import delta_rows

    server, dbname = db18
    names = ["..", "/tmp/cdc_apply_escape", "a/../../b"]
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        for i, schema in enumerate(names):
            conn.execute(f'CREATE SCHEMA "{schema}"')
            conn.execute(f'CREATE TABLE "{schema}"."..{i}" (id int PRIMARY KEY, v text)')
        conn.execute("CREATE PUBLICATION p FOR ALL TABLES")
        create_slot(conn, "hostile")
        for i, schema in enumerate(names):
            conn.execute(f'INSERT INTO "{schema}"."..{i}" SELECT g, {i}::text || g FROM generate_series(1, 3) g')
        raws = list(read_changes(conn, "hostile", PgOutputOptions(("p",))))
        capture = h.write_capture(tmp_path / "c.jsonl", [r.data for r in raws], lsns=[r.lsn for r in raws])
        warehouse = tmp_path / "inner" / "wh"
        replay(spark, [str(capture)], ApplyOptions(warehouse=str(warehouse)))
        outside = [p for p in tmp_path.rglob("_delta_log") if not p.resolve().is_relative_to(warehouse.resolve())]
        assert outside == [] and not Path("/tmp/cdc_apply_escape").exists()
        for i, schema in enumerate(names):
            location = warehouse / path_component(schema) / path_component(f"..{i}")
            qualified = f'"{schema}"."..{i}"'
            expected = sorted(conn.execute(f"SELECT id::text, v FROM {qualified}").fetchall(), key=repr)
            assert len(expected) == 3
            assert delta_rows(spark, str(location), ["id", "v"], _int_text_types()) == expected, schema


def _int_text_types():  # type: ignore[no-untyped-def]
    from cdc_apply.pgtypes import TypeCache

    cache = TypeCache()
    return {"id": cache.get(23), "v": cache.get(25)}


# -- 2 and 3. values: refused, located, never normalised or crashing ---------------------------

VALUE_CASES = [
    # (column type OID, typmod, text value, expected words in the message)
    (1082, -1, b"2021-02-30", "not a calendar date"),
    (1082, -1, b"2020-00-00", "not a calendar date"),
    (1184, -1, b"2020-13-01 00:00:00+00", "not a calendar date"),
    (1184, -1, b"2020-01-01 25:61:61+00", "not a time of day"),
    (1184, -1, b"2020-01-01 10:00:00+99", "not a UTC offset"),
    (1114, -1, b"2020-01-01 24:00:00", "not an ISO timestamp"),
    (1083, -1, b"25:00:00", "not a time of day"),
    (23, -1, b"99999999999", "out of range"),
    (21, -1, b"40000", "out of range"),
    (23, -1, b" 12 ", "not an int4"),
    (23, -1, b"1_000", "not an int4"),
    (20, -1, b"+5", "not an int8"),
    (701, -1, b"1_0", "not a floating-point value"),
    (701, -1, b"inf", "not a floating-point value"),
    (701, -1, b"1e400", "out of range"),
    (700, -1, b"1e39", "out of range"),
    (1700, NUMERIC_10_2, b"1e-9999999", "not a numeric"),
    (1700, NUMERIC_10_2, b"1_000", "not a numeric"),
    (1009, -1, b"{" * 900 + b"}" * 900, "deeper than 6 dimensions"),
    (1009, -1, b"{" * 900, "deeper than 6 dimensions"),
    (1009, -1, b'{"\\', "unterminated quoted array element"),
]


@pytest.mark.parametrize("oid,typmod,value,words", VALUE_CASES)
def test_a_value_its_type_cannot_hold_is_a_located_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         oid: int, typmod: int, value: bytes, words: str) -> None:
    capture = h.one_insert(tmp_path / "c.jsonl", [(1, "id", 23, -1), (0, "c", oid, typmod)], [b"1", value])
    code, err = run_cli(capsys, "decode", "--changes", str(capture))
    assert code == 1
    assert f"{capture}:3, LSN 0/102 (transaction 700, change 0): column 'c'" in err and words in err, err


def test_numeric_exponent_does_not_crash_the_process(tmp_path: Path) -> None:
    """pyarrow 26 dies with SIGSEGV casting this text to decimal128; it must never reach that cast."""
    rows = [[b"1", b"1.50"]] * 50 + [[b"2", b"1e-9999999"]]
    messages = [h.begin(), h.relation([(1, "id", 23, -1), (0, "n", 1700, NUMERIC_10_2)])]
    messages += [h.insert(values) for values in rows] + [h.commit()]
    capture = h.write_capture(tmp_path / "c.jsonl", messages)
    result = run_subprocess("decode", "--changes", str(capture))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "column 'n' (numeric): not a numeric: '1e-9999999'" in result.stderr


def test_a_typmod_postgresql_never_makes_keeps_the_exact_text(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    capture = h.one_insert(tmp_path / "c.jsonl", [(1, "id", 23, -1), (0, "n", 1700, 4)], [b"1", b"1.5"])
    assert run_cli(capsys, "decode", "--changes", str(capture))[0] == 0
    rows = change_rows(Assembler().transactions(read_captures([str(capture)])))
    assert rows[0].rows[0]["new"] == {"id": 1, "n": "1.5"}


def test_binary_array_with_a_zero_dimension_is_empty_without_building_anything() -> None:
    from cdc_apply.pgtypes import TypeCache

    int4_array = TypeCache().get(1007)
    header = struct.pack("!iii", 2, 0, 23) + struct.pack("!ii", 20_000_000, 1) + struct.pack("!ii", 0, 1)
    assert len(header) == 28
    assert int4_array.from_binary(header, -1) == []


@pytest.mark.parametrize("messages,words", [
    ([h.begin(), h.relation([(1, "id", 23, -1), (0, "id", 23, -1)]), h.insert([b"1", b"2"]), h.commit()],
     "message 'R', byte offset 29: column name 'id' appears twice"),
    ([h.begin(), h.relation([(0, f"c{i}", 23, -1) for i in range(1601)])], "column count 1601 is outside 0..1600"),
    ([h.begin(), h.relation([(1, "id", 23, -1)]), h.insert([b"1"]), b"C\x00" + struct.pack("!QQq", 2**64 - 1, 8, 0)],
     "message 'C', byte offset 2: commit LSN 0xffffffffffffffff is past any WAL position"),
    # Stream Start, Relation, a Stream Abort of the top-level xid inside the block, then an Insert.
    ([b"S" + struct.pack("!IB", 900, 1), b"R" + struct.pack("!I", 900) + h.relation([(1, "id", 23, -1)])[1:],
      b"A" + struct.pack("!II", 900, 900), b"I" + struct.pack("!I", 900) + h.insert([b"1"])[1:]],
     "Stream Abort for transaction 900 inside an open stream block"),
])
def test_protocol_violations_are_located_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                messages: list[bytes], words: str) -> None:
    capture = h.write_capture(tmp_path / "c.jsonl", messages)
    code, err = run_cli(capsys, "decode", "--changes", str(capture))
    assert code == 1 and words in err, err


# -- capture files --------------------------------------------------------------------------------

@pytest.mark.parametrize("line,words", [
    ('{"lsn": "0/10", "xid": "abc", "data": "42"}', "xid must be a whole number"),
    ('{"lsn": "0/10", "xid": 1e400, "data": "42"}', "xid must be a whole number"),
    ('{"lsn": "0/10", "xid": -1, "data": "42"}', "xid must be a whole number"),
    ('{"lsn": "0/10", "xid": true, "data": "42"}', "xid must be a whole number"),
    ('[1, 2]', "a JSON object per line"),
    ('{"lsn": "0/10", "xid": 1, "data": 7}', "not a capture line"),
    ('{"lsn": "1 0", "xid": 1, "data": "42"}', "not an LSN"),
    ("[" * 100_000, "not a capture line"),
])
def test_bad_capture_lines_name_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str,
                                              words: str) -> None:
    capture = tmp_path / "c.jsonl"
    capture.write_text(line + "\n")
    code, err = run_cli(capsys, "decode", str(capture))
    assert code == 1 and f"{capture}:1: " in err and words in err, err


def test_binary_and_mistyped_capture_files_are_located_errors(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\n\xff\xfe\x00\x01binary")
    code, err = run_cli(capsys, "decode", str(binary))
    assert code == 1 and f"{binary}:2: not a capture line (not UTF-8" in err, err

    parquet = tmp_path / "s.parquet"
    pq.write_table(pa.table({"lsn": ["0/8"], "xid": [1], "data": ["42"]}), parquet)
    code, err = run_cli(capsys, "decode", str(parquet))
    assert code == 1 and f"{parquet}: Parquet capture column 'data' is string" in err, err

    not_parquet = tmp_path / "n.parquet"
    not_parquet.write_bytes(b"PAR1 not really")
    code, err = run_cli(capsys, "decode", str(not_parquet))
    assert code == 1 and f"{not_parquet}: cannot open Parquet capture" in err, err


def test_unfinished_transactions_and_backward_lsns_are_warned(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    columns = [(1, "id", 23, -1)]
    capture = h.write_capture(tmp_path / "c.jsonl",
                              [h.begin(700), h.relation(columns), h.insert([b"1"]), h.commit(),
                               h.begin(701), h.insert([b"2"])],
                              lsns=[0x200, 0x201, 0x202, 0x203, 0x100, 0x101])
    code, err = run_cli(capsys, "decode", "--changes", str(capture))  # the CLI logs to stderr
    assert code == 0
    assert f"WARNING cdc_apply.sources.capture: {capture}:5: LSN 0/100 goes back from 0/203" in err, err
    assert "the capture ends inside plain transaction 701 (begun at LSN 0/100)" in err, err


def test_decode_changes_streams_its_output(tmp_path: Path) -> None:
    """Rows are printed a batch at a time: the first rows are out before the input is all read."""
    from cdc_apply.decode_cli import CHANGES_PER_BATCH, run_decode

    columns = [(1, "id", 23, -1), (0, "v", 25, -1)]
    messages = [h.relation(columns)]
    for i in range(3 * CHANGES_PER_BATCH):
        messages += [h.begin(1000 + i), h.insert([str(i).encode(), b"x" * 20]), h.commit()]
    capture = h.write_capture(tmp_path / "c.jsonl", messages)

    class Out:
        lines = 0
        lines_when_last_read: int | None = None

        def write(self, text: str) -> None:
            self.lines += text.count("\n")

    out = Out()
    import cdc_apply.decode_cli as decode_cli

    original = decode_cli.read_captures

    def reading(paths):  # type: ignore[no-untyped-def]
        for raw in original(paths):
            yield raw
        out.lines_when_last_read = out.lines

    decode_cli.read_captures = reading  # type: ignore[assignment]
    try:
        assert run_decode([str(capture)], changes=True, out=out) == 0  # type: ignore[arg-type]
    finally:
        decode_cli.read_captures = original  # type: ignore[assignment]
    assert out.lines == 3 * CHANGES_PER_BATCH
    assert out.lines_when_last_read is not None and out.lines_when_last_read >= 2 * CHANGES_PER_BATCH


# -- 4 and 6. configs -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,words", [
    ("batching:\n  max_changes: 1e35\n", "batching.max_changes"),
    ("stream:\n  interval_seconds: .inf\n", "stream.interval_seconds"),
    ("batching:\n  max_seconds: .nan\n", "batching.max_seconds"),
    ("batching:\n  max_changes: 10\n  max_changes: 20\n", "key 'max_changes' appears twice (first at line 2)"),
    ("source:\n  slot: " + "s" * 64 + "\n", "source.slot: a slot name must be 1 to 63 bytes"),
    ("source:\n  slot: Has-Caps\n", "source.slot: String should match pattern"),
    ("source:\n  publication: " + "p" * 64 + "\n", "source.publication: a publication name must be 1 to 63 bytes"),
    ("a: &a [1]\n" + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
                             f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
                             f"*{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9)),
     "expands to more than 100000 values"),
    ("x: " + "[" * 10_000 + "]" * 10_000 + "\n", "x"),
])
def test_bad_configs_exit_2_naming_the_key(tmp_path: Path, text: str, words: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    result = run_subprocess("validate", str(config), memory_bytes=1024**3, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and f"cdc-apply: config error: {config}" in result.stderr
    assert words in result.stderr and len(result.stderr) < 2000, result.stderr


def test_binary_yaml_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_bytes(b"pipeline: x\n\xff\xfe\x00garbage")
    code, err = run_cli(capsys, "validate", str(config))
    assert code == 2 and f"{config}:2: not a YAML text file" in err, err


@pytest.mark.parametrize("text", [
    "source:\n  password: SuperSecret123\n",
    "source:\n  dbname: postgres\n  pasword: SuperSecret123\n",
    "source:\n  port: SuperSecret123\n",
    "source:\n  dsn: 7\n  user: [SuperSecret123]\n",
    "tables:\n  x:\n    token: SuperSecret123\n",
    "source:\n  port: 'password=SuperSecret123'\n",
])
def test_config_errors_never_echo_a_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    code, err = run_cli(capsys, "validate", str(config))
    assert code == 2 and f"{config}: " in err
    assert "SuperSecret123" not in err, err


def test_redaction_keeps_the_message_whole() -> None:
    from cdc_apply.logs import redact

    assert redact("failed for 'host=x password=abc' here") == "failed for 'host=x password=***' here"
    assert redact('conninfo "password=abc user=u"') == 'conninfo "password=*** user=u"'


# -- full-path fuzz: assembly and columnar conversion, not only the decoder --------------------------

TYPED_COLUMNS = [(1, "id", 23, -1), (0, "i8", 20, -1), (0, "f", 701, -1), (0, "n", 1700, NUMERIC_10_2),
                 (0, "d", 1082, -1), (0, "ts", 1184, -1), (0, "a", 1007, -1), (0, "b", 16, -1)]
_VALUE_TEXT = st.one_of(
    st.from_regex(r"-?[0-9]{1,25}(\.[0-9]{0,6})?([eE][+-]?[0-9]{1,8})?", fullmatch=True),
    st.from_regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [0-9]{2}:[0-9]{2}:[0-9]{2}([+-][0-9]{2})?)?", fullmatch=True),
    st.from_regex(r"\{[-0-9,{}\"\\NUL ]{0,30}\}?", fullmatch=True),
    st.sampled_from(["t", "f", "NaN", "Infinity", "-Infinity", "infinity", "", " 1", "+1", "1_0"]),
    st.text(max_size=12),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.one_of(st.none(), _VALUE_TEXT), min_size=len(TYPED_COLUMNS) - 1,
                         max_size=len(TYPED_COLUMNS) - 1), min_size=1, max_size=8))
def test_fuzzed_values_through_assembly_and_columnar_conversion(rows: list[list[str | None]]) -> None:
    """Either every row converts, the columnar and the scalar path agreeing, or a located CdcApplyError."""
    messages = [h.begin(), h.relation(TYPED_COLUMNS)]
    for i, row in enumerate(rows):
        messages.append(h.insert([str(i).encode()] + [None if v is None else v.encode() for v in row]))
    messages.append(h.commit())
    raws = [RawMessage(0x100 + i, 700, data, f"fuzz:{i + 1}") for i, data in enumerate(messages)]
    assembler = Assembler()
    try:
        segments = change_rows(assembler.transactions(raws))
    finally:
        assembler.close()
    for segment in segments:
        try:
            segment.rows
        except CdcApplyError as exc:
            assert "fuzz:" in str(exc) and "column '" in str(exc), str(exc)
            with pytest.raises(CdcApplyError):  # the scalar path refuses the same rows
                segment.scalar_rows()
            continue
        assert_columnar_matches_scalar(segment)
