"""`cdc-apply replay` end to end in a subprocess: summary, idempotence, a table without a key (insert-only)."""

from __future__ import annotations

import re

import psycopg
import pytest

from cdc_apply.sources.capture import write_parquet
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes
from tests.test_decode_cli import _cli


@pytest.mark.spark
def test_replay_twice_applies_once_and_names_a_keyless_table(db18, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE nokey (a int, b text)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        conn.execute("CREATE PUBLICATION p2 FOR TABLE nokey WITH (publish = 'insert')")
        create_slot(conn, "r")
        create_slot(conn, "r2")
        conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 50) g")
        conn.execute("UPDATE t SET v = 'u' WHERE id <= 10")
        conn.execute("DELETE FROM t WHERE id > 40")
        conn.execute("INSERT INTO nokey VALUES (1, 'x')")
        raws = list(read_changes(conn, "r", PgOutputOptions(("p",))))
        keyless = list(read_changes(conn, "r2", PgOutputOptions(("p2",))))
    capture = tmp_path / "c.parquet"
    write_parquet(capture, raws)
    warehouse = tmp_path / "wh"
    first = _cli("replay", str(capture), "--warehouse", str(warehouse))
    assert first.returncode == 0, first.stderr
    assert "public.t" in first.stdout and "I       50 U       10 D       10" in first.stdout
    # Again, with a second capture whose table has no key: the first's batch is skipped, the keyless
    # table is applied insert-only (one process: each start of the CLI costs a JVM).
    keyless_capture = tmp_path / "k.parquet"
    write_parquet(keyless_capture, keyless)
    second = _cli("replay", str(capture), str(keyless_capture), "--warehouse", str(warehouse))
    assert second.returncode == 0, second.stderr
    assert re.search(r"public\.t .*already applied in 1 batch\(es\): skipped", second.stdout), second.stdout
    assert re.search(r"public\.nokey +I +1 ", second.stdout), second.stdout
    assert "public.nokey: no primary key (replica identity default): applied insert-only" in second.stderr

    templated = tmp_path / "templated.yaml"
    templated.write_text(f"target:\n  warehouse: {tmp_path / 'wh2'}\n  path_template: 'cdc_{{schema}}__{{table}}'\n")
    placed = _cli("replay", str(capture), "--config", str(templated))
    assert placed.returncode == 0, placed.stderr
    assert (tmp_path / "wh2" / "cdc_public__t" / "_delta_log").is_dir()
