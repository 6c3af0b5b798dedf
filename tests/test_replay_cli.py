"""`cdc-apply replay` end to end, first in a subprocess, then in this process on the shared session
(each new process costs a JVM): summary, idempotence, a table without a key (insert-only), a path
template."""

from __future__ import annotations

import re

import psycopg
import pytest

from cdc_apply.sources.capture import write_parquet
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes
from tests.test_decode_cli import _cli, _cli_here


def test_replay_twice_applies_once_and_names_a_keyless_table(db18, spark, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
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
    # table is applied insert-only.
    keyless_capture = tmp_path / "k.parquet"
    write_parquet(keyless_capture, keyless)
    code, out, err = _cli_here(capsys, "replay", str(capture), str(keyless_capture), "--warehouse", str(warehouse))
    assert code == 0, err
    assert re.search(r"public\.t .*already applied in 1 batch\(es\): skipped", out), out
    assert re.search(r"public\.nokey +I +1 ", out), out
    assert "public.nokey: no primary key (replica identity default): applied insert-only" in err

    templated = tmp_path / "templated.yaml"
    templated.write_text(f"target:\n  warehouse: {tmp_path / 'wh2'}\n  path_template: 'cdc_{{schema}}__{{table}}'\n")
    code, _, err = _cli_here(capsys, "replay", str(capture), "--config", str(templated))
    assert code == 0, err
    assert (tmp_path / "wh2" / "cdc_public__t" / "_delta_log").is_dir()
