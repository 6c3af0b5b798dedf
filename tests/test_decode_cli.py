"""`cdc-apply decode` on captures written from a real server, JSON Lines and Parquet alike."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import psycopg
import pytest

from cdc_apply.cli import main
from cdc_apply.sources.capture import read_capture, write_jsonl, write_parquet
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cdc_apply.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def _cli_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The CLI's ``main`` in this process, where a verb's Spark session is the tests' shared one
    (``getOrCreate``): a new process would cost a JVM. Returns (exit code, stdout, stderr); the
    logging ``main`` sets up is undone after it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capsys.readouterr()
    try:
        code = main(list(argv))
    finally:
        root.handlers[:], root.level = handlers, level
    out, err = capsys.readouterr()
    return code, out, err


def test_decode_prints_messages_and_change_rows_from_both_formats(db18, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, d date)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        create_slot(conn, "cli")
        conn.execute("INSERT INTO t VALUES (1, 'a', '2024-01-02'), (2, 'b', NULL)")
        conn.execute("UPDATE t SET id = 3 WHERE id = 2")
        conn.execute("DELETE FROM t WHERE id = 1")
        raws = list(read_changes(conn, "cli", PgOutputOptions(("p",), binary=True)))
    jsonl, parquet = tmp_path / "c.jsonl", tmp_path / "c.parquet"
    write_jsonl(jsonl, raws)
    write_parquet(parquet, raws)
    assert list(read_capture(parquet)) == [r.__class__(r.lsn, r.xid, r.data, f"{parquet}:row {i + 1}")
                                           for i, r in enumerate(raws)]

    messages = _cli("decode", str(jsonl))
    assert messages.returncode == 0, messages.stderr
    decoded = [json.loads(line) for line in messages.stdout.splitlines()]
    assert [d["tag"] for d in decoded] == [chr(r.data[0]) for r in raws]
    assert _cli("decode", str(parquet)).stdout == messages.stdout

    changes = _cli("decode", "--changes", str(parquet))
    rows = [json.loads(line) for line in changes.stdout.splitlines()]
    assert [(r["op"], r["key"], r["new"]) for r in rows] == [
        ("I", {"id": 1}, {"id": 1, "v": "a", "d": "2024-01-02"}),
        ("I", {"id": 2}, {"id": 2, "v": "b", "d": None}),
        ("U", {"id": 2}, {"id": 3, "v": "b", "d": None}),
        ("D", {"id": 1}, None),
    ]


def test_decode_names_file_line_lsn_tag_and_offset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"lsn": "0/10", "xid": 1, "data": "42"}\n{"lsn": "0/20", "xid": 1, "data": "55000040"}\n')
    result = _cli("decode", str(bad))
    assert result.returncode == 1
    assert f"{bad}:1, LSN 0/10, message 'B', byte offset 1: truncated" in result.stderr

    not_json = tmp_path / "nojson.jsonl"
    not_json.write_text("{nope\n")
    result = _cli("decode", str(not_json))
    assert result.returncode == 1 and f"{not_json}:1: not a capture line" in result.stderr


def test_unknown_relation_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    capture = tmp_path / "orphan.jsonl"
    begin = "42" + "0000000000000100" + "0000000000000001" + "000002e1"
    insert = "49" + "00004000" + "4e" + "0001" + "74" + "00000001" + "31"
    capture.write_text(f'{{"lsn": "0/10", "xid": 737, "data": "{begin}"}}\n'
                       f'{{"lsn": "0/18", "xid": 737, "data": "{insert}"}}\n')
    result = _cli("decode", "--changes", str(capture))
    assert result.returncode == 1
    assert "LSN 0/18" in result.stderr and "unknown relation OID 16384" in result.stderr
