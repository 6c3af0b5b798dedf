"""Before reading a slot: check the server, create the publication and slot when the config says so.

Every problem is reported at once, each naming what to change (a server setting, a table, a
config key), before any change is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg
from psycopg import sql

from cdc_apply.config import SourceConfig
from cdc_apply.errors import CdcApplyError
from cdc_apply.sources.health import missing_publications
from cdc_apply.sources.slot import FAILOVER_SLOTS_VERSION, PgOutputOptions, create_slot

log = logging.getLogger(__name__)


class PreflightError(CdcApplyError):
    """The source cannot be replicated as configured; the message lists every problem found."""


def protocol_options(source: SourceConfig, version_num: int) -> PgOutputOptions:
    """pgoutput options: the highest protocol the server speaks unless the config fixes one."""
    highest = 4 if version_num >= 160000 else 3 if version_num >= 150000 else 2 if version_num >= 140000 else 1
    proto = source.proto_version or highest
    if proto > highest:
        raise PreflightError(f"source.proto_version: {proto} needs a newer server (this one speaks up to {highest})")
    streaming = source.streaming
    if streaming is None:
        streaming = "parallel" if proto >= 4 else "on" if proto >= 2 else None
    return PgOutputOptions(source.publications, proto, binary=source.binary, messages=source.messages,
                           streaming=streaming, two_phase=source.two_phase, origin=source.origin)


def check_source(conn: psycopg.Connection, source: SourceConfig,
                 has_configured_keys: Callable[[str, str], bool], *, copies: bool = True) -> None:
    """Everything the source needs (docs/getting-started.md, "What the source needs"), each problem
    with its fix: the server's settings, the role's REPLICATION attribute, a replication connection
    that pg_hba.conf lets through, the publications (or the rights to create them), and, when the
    pipeline ``copies`` tables (``snapshot.enabled``), SELECT on every published table."""
    problems = []
    settings = dict(conn.execute(
        "SELECT name, setting FROM pg_settings WHERE name IN ('wal_level', 'max_replication_slots', "
        "'max_wal_senders')").fetchall())
    if settings.get("wal_level") != "logical":
        problems.append(f"wal_level is {settings.get('wal_level')!r}; logical replication needs "
                        "wal_level = logical (ALTER SYSTEM SET wal_level = logical, then restart)")
    if int(settings.get("max_replication_slots", 0)) < 1:
        problems.append("max_replication_slots is 0; set it to at least 1 (then restart)")
    if int(settings.get("max_wal_senders", 0)) < 1:
        problems.append("max_wal_senders is 0; the stream and the initial copy use a replication connection: "
                        "set it to at least 2 (then restart)")
    user, superuser, replication = conn.execute(
        "SELECT rolname, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user").fetchone()  # type: ignore[misc]
    if not (superuser or replication):
        problems.append(f"role {user!r} lacks the REPLICATION attribute; as a superuser: "
                        f"ALTER ROLE {sql.Identifier(user).as_string(conn)} WITH REPLICATION")
    elif int(settings.get("max_wal_senders", 0)) >= 1:
        problems += _replication_connection_problems(source, user)
    missing = missing_publications(conn, source.publications)
    if missing and not source.create_publication:
        problems += [f"publication {name!r} does not exist; create it or set source.create_publication: true"
                     for name in missing]
    elif missing:
        problems += _publication_creation_problems(conn, source, user, superuser)
    if not missing:
        problems += _unreadable_tables(conn, source, user) if copies else []
        for schema, table, identity, has_key in conn.execute(
                "SELECT DISTINCT n.nspname, c.relname, c.relreplident, "
                "EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND (i.indisprimary OR i.indisreplident)) "
                "FROM pg_publication_tables p JOIN pg_namespace n ON n.nspname = p.schemaname "
                "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename WHERE p.pubname = ANY(%s)",
                (list(source.publications),)).fetchall():
            if identity == "d" and not has_key and not has_configured_keys(schema, table):
                # Not a problem: PostgreSQL refuses UPDATE and DELETE on it while it is published.
                log.info("table %s.%s has REPLICA IDENTITY DEFAULT and no primary key: it is applied insert-only "
                         "(give it a primary key or REPLICA IDENTITY FULL to replicate updates and deletes)",
                         schema, table)
    if problems:
        raise PreflightError("the source is not ready for logical replication:\n  - " + "\n  - ".join(problems))


def _replication_connection_problems(source: SourceConfig, user: str) -> list[str]:
    """A replication connection opened and closed. A logical one is matched in pg_hba.conf by its
    database like any other (the ``replication`` keyword there is for physical replication only), so
    what refuses it here is the walsenders: all ``max_wal_senders`` of them in use, say."""
    try:
        with psycopg.connect(source.conninfo(), autocommit=True, replication="database", connect_timeout=10):
            return []
    except psycopg.OperationalError as exc:
        reason = " ".join(str(exc).split())[:300]
        return [f"a replication connection as {user!r} is refused ({reason}); when every walsender is in use, "
                "raise max_wal_senders (then restart) or stop what holds them (pg_stat_replication)"]


def _publication_creation_problems(conn: psycopg.Connection, source: SourceConfig, user: str,
                                   superuser: bool) -> list[str]:
    """``create_publication`` needs CREATE on the database, and FOR ALL TABLES a superuser; FOR TABLE
    needs the tables' ownership, which PostgreSQL checks when it creates the publication."""
    problems = []
    if not conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()[0]:  # type: ignore[index]
        problems.append(f"role {user!r} may not create a publication (source.create_publication): as the "
                        f"database's owner, GRANT CREATE ON DATABASE {sql.Identifier(conn.info.dbname).as_string(conn)} "
                        f"TO {sql.Identifier(user).as_string(conn)}, or create it yourself")
    if not source.publication_tables and not superuser:
        problems.append(f"a publication FOR ALL TABLES needs a superuser, and role {user!r} is not one: list the "
                        "tables in source.publication_tables, or create the publication as a superuser")
    return problems


def _unreadable_tables(conn: psycopg.Connection, source: SourceConfig, user: str) -> list[str]:
    """The initial copy reads each published table with SELECT."""
    return [f"role {user!r} cannot SELECT {schema}.{table}, which the initial copy reads: "
            f"GRANT SELECT ON {sql.Identifier(schema, table).as_string(conn)} TO {sql.Identifier(user).as_string(conn)}"
            for schema, table in conn.execute(
                "SELECT DISTINCT schemaname, tablename FROM pg_publication_tables WHERE pubname = ANY(%s) AND NOT "
                "has_table_privilege(format('%%I.%%I', schemaname, tablename), 'SELECT') ORDER BY 1, 2",
                (list(source.publications),)).fetchall()]


def ensure_publication_and_slot(conn: psycopg.Connection, source: SourceConfig) -> bool:
    """Creates what the config asks for; returns True when the slot was created now."""
    for publication in missing_publications(conn, source.publications) if source.create_publication else ():
        if source.publication_tables:
            tables = sql.SQL(", ").join(sql.Identifier(*name.split(".", 1)) for name in source.publication_tables)
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(publication), tables))
        else:
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(publication)))
        log.info("created publication %s", publication)
    failover_slots = int(conn.info.server_version) >= FAILOVER_SLOTS_VERSION
    failover = source.failover and failover_slots
    row = conn.execute("SELECT plugin, " + ("failover" if failover_slots else "false") +
                       " FROM pg_replication_slots WHERE slot_name = %s", (source.slot,)).fetchone()
    created = row is None
    if row is None:
        if not source.create_slot:
            raise PreflightError(f"replication slot {source.slot!r} does not exist; create it or set "
                                 "source.create_slot: true")
        create_slot(conn, source.slot, two_phase=source.two_phase, failover=failover)
        log.info("created slot %s (two_phase=%s, failover=%s)", source.slot, source.two_phase, failover)
    elif row[0] != "pgoutput":
        raise PreflightError(f"source.slot: slot {source.slot!r} uses plugin {row[0]!r}, not pgoutput")
    elif failover and not row[1]:
        _switch_to_failover(source)
    _say_what_a_failover_does(conn, source, failover_slots)
    return created


def _switch_to_failover(source: SourceConfig) -> None:
    """An existing slot made a failover slot (PostgreSQL 17+), which only a replication command does."""
    try:
        with psycopg.connect(source.conninfo(), autocommit=True, replication="database") as replication:
            replication.execute(sql.SQL("ALTER_REPLICATION_SLOT {} (FAILOVER true)").format(
                sql.Identifier(source.slot)))
    except psycopg.Error as exc:  # in use by another process, say: the health check judges that next
        log.warning("slot %s could not be made a failover slot (source.failover): %s", source.slot,
                    " ".join(str(exc).split()))
        return
    log.info("slot %s is a failover slot now (source.failover)", source.slot)


def _say_what_a_failover_does(conn: psycopg.Connection, source: SourceConfig, failover_slots: bool) -> None:
    """At each start: whether a promoted standby could carry the slot on (docs/operations.md, "Failover")."""
    if not failover_slots:
        log.info("PostgreSQL %s keeps logical slots on the primary only: after a failover, create the slot on the "
                 "new primary and copy every table again (`cdc-apply resync --config <file> --all`)",
                 conn.info.server_version // 10000)
    elif not source.failover:
        log.info("slot %s is not a failover slot (source.failover: false): after a failover, `cdc-apply resync "
                 "--config <file> --all` copies every table again", source.slot)
    elif not conn.execute("SELECT current_setting('synchronized_standby_slots')").fetchone()[0]:  # type: ignore[index]
        log.warning("slot %s is a failover slot, but synchronized_standby_slots is empty on this server: a standby "
                    "may be promoted without the changes this pipeline has read. Set it to the standby's physical "
                    "slot, and sync_replication_slots = on on the standby (docs/operations.md, \"Failover\")",
                    source.slot)

