"""The snapshot's two COPY text parses, into spans (``sources/copy_text.py``, the driver's copy) and
into Arrow columns (``sources/copy_arrow.py``, Spark's tasks): PostgreSQL's own COPY output of
hostile text, random rows in every escape form, each giving the same values by both, and malformed
data refused naming the row."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_apply.errors import CdcApplyError
from cdc_apply.sources.copy_arrow import copy_columns
from cdc_apply.sources.copy_text import parse_copy_text

HOSTILE = ["", "\\N", "\\", "a\tb", "line\nbreak\r\n", "back\\slash\\\\", "\\x41\\101", "ünï\u2028code 🐘",
           "\b\f\v", "N", " \\N "]


def _values(data: bytes, columns: int) -> list[list[bytes | None]]:
    """The values by the span parse; the Arrow parse must give the same."""
    rows = parse_copy_text(data, columns, lambda row: f"row {row}")
    values = [[None if rows.is_null[r, c] else rows.buf[rows.starts[r, c]:rows.starts[r, c] + rows.lengths[r, c]].tobytes()
               for c in range(columns)] for r in range(len(rows))]
    by_arrow = copy_columns(data, columns, lambda row: f"row {row}")
    assert [list(row) for row in zip(*(column.to_pylist() for column in by_arrow))] == values
    return values


def test_postgres_copy_output_of_hostile_text_parses_to_the_stored_values(db18) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE hostile (id int PRIMARY KEY, a text, b text, c bytea)")
        for i, value in enumerate(HOSTILE):
            conn.execute("INSERT INTO hostile VALUES (%s, %s, %s, %s)",
                         (i, value, None if i % 3 == 0 else value[::-1], value.encode()))
        conn.execute("INSERT INTO hostile VALUES (100, NULL, NULL, NULL)")
        conn.execute("SET client_encoding TO 'UTF8'")
        with conn.cursor().copy("COPY (SELECT id, a, b, c FROM hostile ORDER BY id) TO STDOUT") as copy:
            data = b"".join(bytes(block) for block in copy)
        want = [[None if v is None else v.encode() for v in row]
                for row in conn.execute("SELECT id::text, a, b, c::text FROM hostile ORDER BY hostile.id").fetchall()]
    assert _values(data, 4) == want
    assert _values(b"", 4) == []


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_ESCAPES = {ord("\\"): [b"\\\\", b"\\134", b"\\x5c"], ord("\t"): [b"\\t", b"\\011", b"\\x09"],
            ord("\n"): [b"\\n", b"\\012"], ord("\r"): [b"\\r", b"\\x0D"], 8: [b"\\b"], 12: [b"\\f"], 11: [b"\\v"]}


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.lists(st.none() | _TEXT, min_size=n, max_size=n), max_size=6))), st.randoms())
def test_every_escape_form_round_trips(shape: tuple[int, list[list[str | None]]], random) -> None:  # type: ignore[no-untyped-def]
    columns, rows = shape
    lines = []
    for row in rows:
        fields = []
        for value in row:
            if value is None:
                fields.append(b"\\N")
                continue
            out = bytearray()
            for byte in value.encode():
                forms = _ESCAPES.get(byte)
                out += random.choice(forms) if forms else bytes([byte])
            fields.append(bytes(out))
        lines.append(b"\t".join(fields) + b"\n")
    assert _values(b"".join(lines), columns) == [[None if v is None else v.encode() for v in row] for row in rows]


@pytest.mark.parametrize(("data", "message"), [
    (b"1\tx\n2\n", "row 1: the COPY row has 1 columns, the table 2"),
    (b"1\tx\n2\ty\tz\n", "row 1: the COPY row has 3 columns, the table 2"),
    (b"1\tx\n2\ty", "row 1: the COPY data ends inside a row"),
    (b"1\tx\\\n", "row 0: a COPY value ends in a lone backslash"),
])
def test_malformed_copy_data_is_refused_naming_the_row(data: bytes, message: str) -> None:
    with pytest.raises(CdcApplyError, match=message):
        parse_copy_text(data, 2, lambda row: f"row {row}")


@pytest.mark.parametrize(("data", "message"), [
    (b"1\tx\n2\n", "rows of the chunk: the COPY rows do not have 2 columns each: .*Expected 2 columns, got 1"),
    (b"1\tx\n2\ty\tz\n", "rows of the chunk: the COPY rows do not have 2 columns each: .*Expected 2 columns, got 3"),
    (b"1\tx\n2\ty", "row 1: the COPY data ends inside a row"),
    (b"1\tx\\\n", "row 0: a COPY value ends in a lone backslash"),
])
def test_malformed_copy_data_is_refused_by_the_arrow_parse_too(data: bytes, message: str) -> None:
    with pytest.raises(CdcApplyError, match=message):
        copy_columns(data, 2, lambda row: "rows of the chunk" if row is None else f"row {row}")
