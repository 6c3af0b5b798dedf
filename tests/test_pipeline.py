"""`cdc-apply run` in SQL-interface batch mode against a real server: oracle, two-phase across runs,
windows smaller than a transaction, preflight errors, and the run/status/capture verbs."""

from __future__ import annotations

import json

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.pgserver import PgServer, available_bindirs
from cdc_apply.pipeline import drain
from cdc_apply.status import pipeline_status
from cdc_apply.sources.preflight import PreflightError
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from tests.test_decode_cli import _cli
from tests.workloads import BIG_TEXT

TABLES = {"public.orders": ["id", "customer", "amount", "note"], "public.events": ["a", "b"]}
SCHEMA = """
CREATE TABLE orders (id int PRIMARY KEY, customer text, amount numeric(10,2), note text);
CREATE TABLE events (a int, b text);
ALTER TABLE events REPLICA IDENTITY FULL;
CREATE PUBLICATION "shop pub" FOR TABLE orders, events;
"""


def _config(server: PgServer, dbname: str, warehouse: str, **source: object):  # type: ignore[no-untyped-def]
    return parse_config({"pipeline": "shop", "source": {"dsn": server.conninfo(dbname), "slot": "shop",
                                                        "publication": "shop pub", "two_phase": True, **source},
                         "target": {"warehouse": warehouse}, "batching": {"max_changes": 50}})


def _assert_equal(spark, conn, warehouse):  # type: ignore[no-untyped-def]
    for name, columns in TABLES.items():
        truth = postgres_rows(conn, name, columns)
        got = delta_rows(spark, f"{warehouse}/{name.replace('.', '/')}", columns, source_types(conn, name))
        assert got == truth, name


def test_runs_apply_everything_and_never_confirm_past_a_prepared_transaction(db18, spark, tmp_path):  # type: ignore[no-untyped-def]
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = _config(server, dbname, warehouse)
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute(SCHEMA)
        assert not drain(config, spark).batches  # creates the slot (two-phase)
        conn.execute("INSERT INTO orders SELECT g, 'c' || g % 7, g * 1.5, NULL FROM generate_series(1, 300) g")
        conn.execute(f"UPDATE orders SET note = {BIG_TEXT} WHERE id <= 3")
        conn.execute("INSERT INTO events VALUES (1, 'x'), (3, 'x'), (2, NULL)")
        conn.execute("SET logical_decoding_work_mem = '64kB'")
        with conn.transaction():  # one transaction far larger than the 50-message window
            conn.execute("INSERT INTO orders SELECT g, 'big', g, repeat('n', 100) FROM generate_series(1000, 2999) g")
            conn.execute("DELETE FROM orders WHERE id BETWEEN 10 AND 20")
        first = drain(config, spark)
        assert len(first.batches) >= 2 and first.rounds >= 3 and first.confirmed_lsn
        _assert_equal(spark, conn, warehouse)

        conn.execute("UPDATE orders SET amount = amount + 1, customer = 'moved' WHERE id <= 5")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO orders VALUES (5000, 'prepared', 1, NULL)")
        conn.execute("PREPARE TRANSACTION 'g1'")
        conn.execute("UPDATE events SET b = 'y' WHERE a = 2")
        second = drain(config, spark)
        assert second.batches
        _assert_equal(spark, conn, warehouse)  # the prepared row is not visible in PostgreSQL either

        conn.execute("COMMIT PREPARED 'g1'")
        third = drain(config, spark)
        assert third.batches
        _assert_equal(spark, conn, warehouse)  # the prepared changes were kept for their commit
        status = pipeline_status(config)
        slot = status["slot"]
        assert slot["exists"] and slot["two_phase"] and slot["unconfirmed_bytes"] < 1_000_000
        assert slot["wal_status"] == "reserved" and slot["active_pid"] is None
        applied = {row["table"]: row["applied_lsn"] for row in status["tables"]}
        assert applied["public.orders"] is not None and applied["public.events"] is not None

        # WAL of an unpublished table only: nothing to apply, but the slot moves over it (the
        # replication core's idle advance), so a quiet publication does not hold the server's WAL.
        conn.execute("CREATE TABLE elsewhere AS SELECT g, repeat('w', 200) AS pad FROM generate_series(1, 20000) g")
        before = pipeline_status(config)["slot"]["unconfirmed_bytes"]
        nothing = drain(config, spark)
        after = pipeline_status(config)["slot"]["unconfirmed_bytes"]
        assert not nothing.batches and nothing.confirmed_lsn is not None
        assert before > 4_000_000 and after < 100_000, (before, after)
        _assert_equal(spark, conn, warehouse)


def test_preflight_names_every_problem(db18, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    missing = _config(server, dbname, str(tmp_path), publication="nope", create_slot=False)
    with pytest.raises(PreflightError, match="publication 'nope' does not exist; create it or set "
                                             "source.create_publication: true"):
        drain(missing, None)  # type: ignore[arg-type]

    replica = PgServer(bindir=available_bindirs()["pg18"], settings={"wal_level": "replica"}).start()
    try:
        config = parse_config({"source": {"dsn": replica.dsn, "create_publication": True}})
        with pytest.raises(PreflightError, match="wal_level is 'replica'; logical replication needs"):
            drain(config, None)  # type: ignore[arg-type]
    finally:
        replica.stop()


@pytest.mark.spark
def test_capture_status_and_run_verbs(db18, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute(SCHEMA)
    config = tmp_path / "shop.yaml"
    config.write_text(json.dumps({"pipeline": "shop", "target": {"warehouse": str(tmp_path / "wh")},
                                  "snapshot": {"enabled": False},  # the counts below come from the slot
                                  "source": {"dsn": server.conninfo(dbname) + " password=hunter2", "slot": "cli",
                                             "publication": "shop pub"}}))
    assert _cli("status", "--config", str(config)).returncode == 1  # no slot yet
    capture = _cli("capture", "--config", str(config), "--out", str(tmp_path / "c.jsonl"))
    assert capture.returncode == 0, capture.stderr  # creates the slot; nothing to capture yet
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("INSERT INTO orders VALUES (1, 'a', 1, NULL), (2, 'b', 2, NULL)")
        conn.execute("DELETE FROM orders WHERE id = 1")
    capture = _cli("capture", "--config", str(config), "--out", str(tmp_path / "c.jsonl"))
    assert capture.returncode == 0 and "wrote 8 messages" in capture.stdout, capture.stdout + capture.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["messages"] == 8 and manifest["options"]["publication_names"] == '"shop pub"'
    before = json.loads(_cli("status", "--config", str(config)).stdout)
    assert before["slot"]["unconfirmed_bytes"] > 0 and before["publication"] == {"names": ["shop pub"], "exists": True, "missing": []}
    # The run's logs as JSON (one JVM for both checks): structured, and never showing the password.
    run = _cli("--log-format", "json", "-v", "run", "--config", str(config), "--once")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "public.orders" in run.stdout and "I        2 U        0 D        1" in run.stdout
    assert "hunter2" not in run.stdout + run.stderr
    records = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    messages = [r["message"] for r in records]
    assert any(m.startswith("public.orders: {'I': 2, 'D': 1} in ") for m in messages), messages
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    after = json.loads(_cli("status", "--config", str(config)).stdout)
    assert after["slot"]["confirmed_flush_lsn"] != before["slot"]["confirmed_flush_lsn"]
    applied = {row["table"]: row["applied_lsn"] for row in after["tables"]}
    assert applied["public.orders"] and applied["public.events"] is None  # events had no change to apply


def test_add_column_default_reaches_rows_that_existed_before(db18, spark, tmp_path):  # type: ignore[no-untyped-def]
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "dflt", "source": {"dsn": server.conninfo(dbname), "slot": "dflt",
                                                          "publication": "dflt"},
                           "target": {"warehouse": warehouse}, "defaults": {"schema_policy": "evolve"}})
    columns = ["id", "a", "status", "n", "noise"]
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, a text); CREATE PUBLICATION dflt FOR TABLE items")
        conn.execute("INSERT INTO items SELECT g, 'a' || g FROM generate_series(1, 50) g")
        assert drain(config, spark).snapshots[0].rows == 50
        conn.execute("INSERT INTO items SELECT g, 'b' || g FROM generate_series(51, 60) g")  # same batch, before
        conn.execute("UPDATE items SET a = 'changed' WHERE id = 1")
        conn.execute("ALTER TABLE items ADD COLUMN status text DEFAULT 'new', ADD COLUMN n numeric(6,2) DEFAULT 7.5")
        conn.execute("INSERT INTO items VALUES (61, 'c', 'given', 1)")
        conn.execute("UPDATE items SET a = 'after' WHERE id = 2")
        drain(config, spark)
        # A volatile default rewrites the table: the catalog keeps no value for the rows before.
        conn.execute("ALTER TABLE items ADD COLUMN noise float8 DEFAULT random()")
        conn.execute("UPDATE items SET a = 'later' WHERE id = 2")
        drain(config, spark)
        truth = postgres_rows(conn, "public.items", columns)
        got = delta_rows(spark, f"{warehouse}/public/items", columns, source_types(conn, "public.items"))
        # Constant defaults reach every row; a volatile default's values are unknown to the catalog,
        # so rows not written since keep NULL (documented), the others carry their WAL values.
        untouched = {str(i) for i in range(1, 62)} - {"2"}  # not written since noise was added
        assert [r[:4] for r in got] == [r[:4] for r in truth]
        assert all(r[4] is None for r in got if r[0] in untouched)
        assert [r for r in got if r[0] not in untouched] == [r for r in truth if r[0] not in untouched]


def test_a_failed_verb_s_json_logs_never_show_the_password(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A run's JSON logs: test_capture_status_and_run_verbs.
    broken = tmp_path / "broken.yaml"
    broken.write_text(json.dumps({"source": {"dsn": "host=127.0.0.1 port=1 password=hunter2 connect_timeout=2"}}))
    failed = _cli("--log-format", "json", "status", "--config", str(broken))
    assert failed.returncode != 0 and "hunter2" not in failed.stdout + failed.stderr
    assert "port 1" in failed.stderr or "127.0.0.1" in failed.stderr, failed.stderr


def test_slots_are_failover_slots_where_the_server_has_them(any_db, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL 17+: the slot is created as a failover slot, an existing one is switched over,
    ``status`` shows ``failover`` and ``synced``, and a start without synchronized_standby_slots
    warns naming it. Before 17, the log says a failover means a re-copy, and how."""
    from cdc_apply.pipeline import prepare_source
    from cdc_apply.sources.slot import create_slot

    server, dbname = any_db
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute(SCHEMA)
        newer = conn.info.server_version >= 170000
        create_slot(conn, "old")  # an ordinary slot, as earlier versions of cdc_apply made them
    for slot in ("shop", "old"):
        config = _config(server, dbname, str(tmp_path), slot=slot, two_phase=False)
        caplog.clear()
        with caplog.at_level("INFO", logger="cdc_apply.sources.preflight"):
            prepare_source(config)
        status = pipeline_status(config)["slot"]
        if newer:
            assert (status["failover"], status["synced"]) == (True, False), slot
            assert f"slot {slot} is a failover slot, but synchronized_standby_slots is empty" in caplog.text
        else:
            assert (status["failover"], status["synced"]) == (None, None)
            assert "after a failover, create the slot on the new primary and copy every table again " \
                   "(`cdc-apply resync --config <file> --all`)" in caplog.text
    config = _config(server, dbname, str(tmp_path), slot="plain", failover=False)
    prepare_source(config)
    assert pipeline_status(config)["slot"]["failover"] is (False if newer else None)
