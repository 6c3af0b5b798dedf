"""Preflight names everything the source lacks, each with its fix, against a real server and a role
that is not a superuser: the REPLICATION attribute, max_wal_senders (none, or all in use), SELECT on a
published table, a missing publication and the rights to create one."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.preflight import PreflightError, check_source


def _config(server: PgServer, dbname: str, user: str, **source: object):  # type: ignore[no-untyped-def]
    dsn = f"host=127.0.0.1 port={server.port} dbname={dbname} user={user}"
    return parse_config({"source": {"dsn": dsn, "publication": "pub", **source}})


def _problems(server: PgServer, dbname: str, user: str, **source: object) -> str:
    config = _config(server, dbname, user, **source)
    with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
        with pytest.raises(PreflightError) as refused:
            check_source(conn, config.source, lambda schema, table: False)
    return str(refused.value)


@pytest.fixture()
def source(any_db) -> Iterator[tuple[PgServer, str, psycopg.Connection]]:  # type: ignore[no-untyped-def]
    """A database with a published table, and a superuser connection to it."""
    server, dbname = any_db
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as admin:
        admin.execute("CREATE TABLE orders (id int PRIMARY KEY, note text)")
        admin.execute("CREATE PUBLICATION pub FOR TABLE orders")
        yield server, dbname, admin
        for (role,) in admin.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE %s", (f"{dbname}\\_%",)).fetchall():
            admin.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM "{role}"')
            admin.execute(f'REVOKE ALL ON DATABASE "{dbname}" FROM "{role}"')
            admin.execute(f'DROP ROLE "{role}"')


def test_a_role_ready_for_replication_passes(source) -> None:  # type: ignore[no-untyped-def]
    server, dbname, admin = source
    user = f"{dbname}_ready"
    admin.execute(f'CREATE ROLE "{user}" LOGIN REPLICATION')
    admin.execute(f'GRANT SELECT ON orders TO "{user}"')
    config = _config(server, dbname, user)
    with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
        check_source(conn, config.source, lambda schema, table: False)


def test_a_role_without_replication_or_select_is_told_both_fixes(source) -> None:  # type: ignore[no-untyped-def]
    server, dbname, admin = source
    user = f"{dbname}_plain"
    admin.execute(f'CREATE ROLE "{user}" LOGIN')
    message = _problems(server, dbname, user)
    assert f"role '{user}' lacks the REPLICATION attribute; as a superuser: ALTER ROLE \"{user}\" WITH REPLICATION" \
        in message, message
    assert f"role '{user}' cannot SELECT public.orders, which the initial copy reads: GRANT SELECT ON " \
           f"\"public\".\"orders\" TO \"{user}\"" in message, message
    # Without the copy (snapshot.enabled: false) SELECT is not needed.
    config = _config(server, dbname, user)
    with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
        with pytest.raises(PreflightError) as refused:
            check_source(conn, config.source, lambda schema, table: False, copies=False)
    assert "cannot SELECT" not in str(refused.value) and "REPLICATION attribute" in str(refused.value)


def test_creating_a_publication_needs_create_on_the_database_and_for_all_tables_a_superuser(source) -> None:  # type: ignore[no-untyped-def]
    server, dbname, admin = source
    user = f"{dbname}_nopub"
    admin.execute(f'CREATE ROLE "{user}" LOGIN REPLICATION')
    admin.execute(f'REVOKE CREATE ON DATABASE "{dbname}" FROM PUBLIC')
    missing = _problems(server, dbname, user, publication="other")
    assert "publication 'other' does not exist; create it or set source.create_publication: true" in missing, missing
    message = _problems(server, dbname, user, publication="other", create_publication=True)
    assert f"role '{user}' may not create a publication (source.create_publication): as the database's owner, " \
           f"GRANT CREATE ON DATABASE \"{dbname}\" TO \"{user}\"" in message, message
    assert "a publication FOR ALL TABLES needs a superuser" in message, message
    listed = _problems(server, dbname, user, publication="other", create_publication=True,
                       publication_tables=["public.orders"])
    assert "FOR ALL TABLES" not in listed and "may not create a publication" in listed, listed


@pytest.mark.pg
def test_max_wal_senders_zero_or_all_in_use_is_named() -> None:
    with PgServer(settings={"max_wal_senders": "0"}) as server, \
            psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        admin.execute("CREATE PUBLICATION pub FOR TABLE orders")
        message = _problems(server, "postgres", "postgres")
    assert "max_wal_senders is 0; the stream and the initial copy use a replication connection: set it to at " \
           "least 2 (then restart)" in message, message
    with PgServer(settings={"max_wal_senders": "1"}) as server, \
            psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        admin.execute("CREATE PUBLICATION pub FOR TABLE orders")
        with psycopg.connect(server.dsn, autocommit=True, replication="database"):  # the one walsender
            message = _problems(server, "postgres", "postgres")
    assert "a replication connection as 'postgres' is refused (" in message and "max_wal_senders" in message, message
    assert "raise max_wal_senders (then restart) or stop what holds them (pg_stat_replication)" in message, message
