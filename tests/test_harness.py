"""The harness is real: a throwaway PostgreSQL with logical decoding, and Spark with Delta."""

from __future__ import annotations

import os
import pwd
import subprocess
import threading

import psycopg
import pytest

from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import PgOutputDecoder
from cdc_apply.pgserver import PgServer, _service_user
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes


def test_server_is_configured_for_logical_decoding(any_db) -> None:  # type: ignore[no-untyped-def]
    server, dbname = any_db
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        settings = dict(conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('wal_level', 'max_prepared_transactions', 'max_replication_slots', 'TimeZone')").fetchall())
        assert settings["wal_level"] == "logical" and int(settings["max_prepared_transactions"]) > 0
        assert int(settings["max_replication_slots"]) >= 10 and settings["TimeZone"] == "UTC"
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        create_slot(conn, "harness")
        conn.execute("INSERT INTO t VALUES (1, 'hello')")
        raws = list(read_changes(conn, "harness", PgOutputOptions(("p",))))
    decoder = PgOutputDecoder()
    inserts = [msg for msg in map(decoder.decode, (r.data for r in raws)) if isinstance(msg, m.Insert)]
    assert [i.new.values for i in inserts] == [(b"1", b"hello")]


@pytest.mark.pg
def test_server_is_stopped_and_removed_even_after_a_failure() -> None:
    server = PgServer()
    try:
        with server:
            root = server.root
            assert root is not None and (root / "data" / "postmaster.pid").exists()
            raise RuntimeError("a failing test")
    except RuntimeError:
        pass
    assert server.root is None and not root.exists()


@pytest.mark.pg
def test_a_started_server_used_as_a_context_manager_is_not_started_again() -> None:
    with PgServer().start() as server:
        root = server.root
        with psycopg.connect(server.dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    assert server.root is None and root is not None and not root.exists()


def test_delta_merge_round_trip(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from delta.tables import DeltaTable

    path = str(tmp_path / "t")
    spark.createDataFrame([(1, "a"), (2, "b")], "id int, v string").write.format("delta").save(path)
    target = DeltaTable.forPath(spark, path)
    source = spark.createDataFrame([(2, "B"), (3, "c")], "id int, v string")
    (target.alias("t").merge(source.alias("s"), "t.id = s.id")
     .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())
    rows = sorted(tuple(r) for r in spark.read.format("delta").load(path).collect())
    assert rows == [(1, "a"), (2, "B"), (3, "c")]
    operations = [r.operation for r in target.history().collect()]
    assert operations[0] == "MERGE" and "WRITE" in operations
    properties = {r.key: r.value for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()}
    assert properties.get("delta.enableDeletionVectors") == "true"
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"


def test_several_processes_creating_the_servers_user_at_once_all_get_it() -> None:
    # On a new machine the two test workers' first servers ask for the user at the same moment: the
    # useradd that comes second used to fail (the user exists, or the user database is locked), and
    # then every PostgreSQL test of that worker errored at setup.
    name = f"cdcrace{os.getpid() % 100000}"
    if os.geteuid() != 0:
        assert _service_user(name) is None  # not root: the server runs as ourselves
        return
    start = threading.Barrier(6)
    found: list[object] = []

    def ask() -> None:
        start.wait()
        try:
            found.append(_service_user(name))
        except Exception as exc:  # noqa: BLE001 - the test reports what each asker got
            found.append(exc)

    askers = [threading.Thread(target=ask) for _ in range(6)]
    try:
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
        final_uid = pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)
    assert [getattr(user, "pw_name", user) for user in found] == [name] * 6
    # One user for all of them, and the one that stays: two useradds at once each added the name
    # with a uid of its own, and a server then ran as the uid that vanished (initdb: "could not
    # look up effective user ID").
    assert {getattr(user, "pw_uid", None) for user in found} == {final_uid}
