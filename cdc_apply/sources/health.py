"""Slot health: is the replication slot still usable, by us alone, and how much WAL does it hold back?

Checked before a run reads the slot and every ``source.health_interval_seconds`` while it runs
(docs/operations.md lists each problem and its recovery):
- an invalidated slot (``wal_status = 'lost'``; ``invalidation_reason`` on PostgreSQL 17+) can
  never be read again: ``SlotUnusable``, naming the recovery (a new slot and ``resync --all``);
- a slot in use by another process (``active_pid``): ``SlotUnusable`` after a short wait, since
  the walsender of a process that just died may still hold it for a moment;
- a publication that no longer exists: ``SlotUnusable``;
- a table that left the publication: a warning (its target stops receiving changes);
- retained WAL (``pg_current_wal_lsn() - restart_lsn``) above ``source.max_retained_wal``: a
  warning, or ``SlotUnusable`` with ``on_retained_wal: stop``.

A check is bounded in time on the client's side (``bounded_in_time``): TCP keepalives and
``tcp_user_timeout`` (``config.TCP_DEFAULTS``) catch a dead network path, but not a peer that
acknowledges every byte and answers nothing (a frozen server, a proxy that stopped forwarding).
Past ``HealthMonitor.timeout_seconds`` the connection is shut down and the check fails with
``HealthCheckTimeout``, a ``psycopg.OperationalError``: the runner's reconnect path takes it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Protocol

import psycopg

from cdc_apply.config import SourceConfig
from cdc_apply.errors import CdcApplyError
from cdc_apply.sources.slot import FAILOVER_SLOTS_VERSION, SLOT_GONE

log = logging.getLogger(__name__)

ACTIVE_WAIT_SECONDS = 10.0
HEALTH_CHECK_SECONDS = 30.0  # a check's queries, past the wait for a slot's previous reader to let go


class HealthCheckTimeout(psycopg.OperationalError):
    """The server did not answer a health check in time: the connection is treated as lost."""


@contextmanager
def bounded_in_time(conn: psycopg.Connection, seconds: float, what: str) -> Iterator[None]:
    """Queries on ``conn`` within ``seconds``, or the connection's socket is shut down (which ends a
    read blocked on it) and ``HealthCheckTimeout`` names ``what`` and the server."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        try:
            with socket.fromfd(conn.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM) as duplicate:
                duplicate.shutdown(socket.SHUT_RDWR)  # the connection itself, through a duplicate descriptor
        except OSError:
            pass  # closed meanwhile

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except psycopg.Error as exc:
        if expired.is_set():
            raise HealthCheckTimeout(f"{what}: no answer from {conn.info.host}:{conn.info.port} in {seconds:g} s "
                                     "(the server or the network path stopped answering)") from exc
        raise
    finally:
        timer.cancel()


class SlotUnusable(CdcApplyError):
    """The slot or publication cannot be replicated from; the message names the recovery."""


@dataclass(frozen=True)
class SlotHealth:
    slot: str
    exists: bool
    current_wal_lsn: str
    wal_status: str | None = None  # reserved, extended, unreserved or lost
    invalidation_reason: str | None = None  # PostgreSQL 17+
    active_pid: int | None = None
    restart_lsn: str | None = None
    confirmed_flush_lsn: str | None = None
    retained_wal_bytes: int | None = None  # WAL the server keeps for this slot
    unconfirmed_bytes: int | None = None  # WAL written since the slot's confirmed position
    safe_wal_size: int | None = None  # bytes left before max_slot_wal_keep_size invalidates it
    two_phase: bool | None = None
    failover: bool | None = None  # a failover slot (PostgreSQL 17+; None before)
    synced: bool | None = None  # a copy a standby synchronized from its primary (PostgreSQL 17+)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def read_slot_health(conn: psycopg.Connection, slot: str) -> SlotHealth:
    v17 = int(conn.info.server_version) >= FAILOVER_SLOTS_VERSION
    current = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
    row = conn.execute(
        "SELECT wal_status, " + ("invalidation_reason" if v17 else "NULL::text") + ", active_pid, "
        "restart_lsn::text, confirmed_flush_lsn::text, "
        "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, "
        "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, safe_wal_size, two_phase, "
        + ("failover, synced " if v17 else "NULL::bool, NULL::bool ") +
        "FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    if row is None:
        return SlotHealth(slot, False, current)
    return SlotHealth(slot, True, current, *row)


def missing_standby_slots(conn: psycopg.Connection) -> list[str]:
    """The physical slots ``synchronized_standby_slots`` names that this server does not have
    (PostgreSQL 17+). The server then sends a failover slot's reader nothing at all, waiting for a
    standby that cannot confirm: typical right after a promotion, before the new standby is attached."""
    if int(conn.info.server_version) < FAILOVER_SLOTS_VERSION:
        return []
    setting = conn.execute("SELECT current_setting('synchronized_standby_slots')").fetchone()[0]  # type: ignore[index]
    names = [name.strip().strip('"') for name in str(setting).split(",") if name.strip()]
    found = {row[0] for row in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' "
                                            "AND slot_name = ANY(%s)", (names,)).fetchall()}
    return [name for name in names if name not in found]


def standby_copies(source: SourceConfig, primary: psycopg.Connection) -> list[dict[str, object]]:
    """The slot's copy on every other server ``source.dsn`` lists (its standbys, in a host list):
    whether the server is in recovery, and whether it holds a synchronized, persistent copy of the
    slot and how far that copy is confirmed. A sync first makes a temporary copy, which a promotion
    drops; it turns persistent once the primary's slot has moved past the standby's own position."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(source.conninfo())
    hosts = str(params.get("host") or "").split(",")
    ports = str(params.get("port") or "5432").split(",")
    ports = ports * len(hosts) if len(ports) == 1 else ports
    if len(hosts) < 2:
        return []
    copies: list[dict[str, object]] = []
    for host, port in zip(hosts, ports):
        if (host, port) == (primary.info.host, str(primary.info.port)):
            continue
        copy: dict[str, object] = {"server": f"{host}:{port}"}
        try:
            with psycopg.connect(make_conninfo(source.conninfo(), host=host, port=port, target_session_attrs="any"),
                                 autocommit=True, connect_timeout=5) as conn:
                copy["in_recovery"] = conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]  # type: ignore[index]
                row = conn.execute("SELECT synced, temporary, confirmed_flush_lsn::text FROM pg_replication_slots "
                                   "WHERE slot_name = %s", (source.slot,)).fetchone() \
                    if int(conn.info.server_version) >= FAILOVER_SLOTS_VERSION else None
                copy.update(dict(zip(("synced", "temporary", "confirmed_flush_lsn"), row or (False, None, None))))
        except psycopg.Error as exc:
            copy["error"] = " ".join(str(exc).split())
        copies.append(copy)
    return copies


def missing_publications(conn: psycopg.Connection, publications: Sequence[str]) -> list[str]:
    """The names among ``publications`` that the database has no publication of."""
    found = {row[0] for row in conn.execute("SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                                            (list(publications),)).fetchall()}
    return [name for name in publications if name not in found]


def publication_tables(conn: psycopg.Connection, publications: Sequence[str]) -> dict[int, str] | None:
    """relation OID -> schema.table of every table the publications send (a table in several counts
    once); None when one of them does not exist."""
    if missing_publications(conn, publications):
        return None
    return {oid: f"{schema}.{table}" for oid, schema, table in conn.execute(
        "SELECT DISTINCT c.oid, p.schemaname, p.tablename FROM pg_publication_tables p "
        "JOIN pg_namespace n ON n.nspname = p.schemaname "
        "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename WHERE p.pubname = ANY(%s)",
        (list(publications),)).fetchall()}


def _invalidated(health: SlotHealth, source: SourceConfig) -> str:
    reason = f" ({health.invalidation_reason})" if health.invalidation_reason else ""
    return (f"replication slot {source.slot!r} was invalidated by the server{reason}: the WAL it needed is gone "
            "and the changes in it are lost. Recover: drop the slot (SELECT pg_drop_replication_slot("
            f"'{source.slot}')), then run `cdc-apply resync --config <file> --all`, which creates a new slot and "
            "copies every table again (docs/operations.md, \"Slot problems\")")


class SlotObserver(Protocol):
    def observe_slot(self, health: SlotHealth) -> None: ...


class HealthMonitor:
    """Runs the checks for one pipeline; remembers the publication's tables to see one leave."""

    def __init__(self, source: SourceConfig, observer: SlotObserver | None = None) -> None:
        self.source = source
        self.observer = observer  # the metrics, told the slot's numbers at each check
        self.tables: dict[int, str] | None = None
        self.checked_at = 0.0
        self.timeout_seconds = HEALTH_CHECK_SECONDS

    def due(self) -> bool:
        return time.monotonic() - self.checked_at >= self.source.health_interval_seconds

    def check(self, conn: psycopg.Connection, *, own_pid: int | None = None, starting: bool = False) -> SlotHealth:
        """Raises ``SlotUnusable`` for a problem that stops the pipeline; logs the others.

        ``starting``: nothing of ours reads the slot yet, so any ``active_pid`` is another process's;
        ``own_pid``: the backend of our walsender connection. With neither (the Spark data source peeks
        and advances from its own backends) the slot's user is not judged."""
        seconds = self.timeout_seconds + (ACTIVE_WAIT_SECONDS if starting else 0.0)
        with bounded_in_time(conn, seconds, f"the health check of slot {self.source.slot!r}"):
            return self._check(conn, own_pid=own_pid, starting=starting)

    def _check(self, conn: psycopg.Connection, *, own_pid: int | None, starting: bool) -> SlotHealth:
        self.checked_at = time.monotonic()
        source = self.source
        health = read_slot_health(conn, source.slot)
        if starting and health.exists and health.active_pid is not None and health.active_pid != own_pid:
            deadline = time.monotonic() + ACTIVE_WAIT_SECONDS
            while health.active_pid is not None and time.monotonic() < deadline:
                time.sleep(0.5)
                health = read_slot_health(conn, source.slot)
        if self.observer is not None:
            self.observer.observe_slot(health)
        if starting and not health.exists:
            raise SlotUnusable(f"replication slot {source.slot!r} does not exist on {source.describe()} "
                               f"(server {conn.info.host}:{conn.info.port}), though this pipeline read it before: "
                               + SLOT_GONE)
        if health.exists and health.wal_status == "lost":
            raise SlotUnusable(_invalidated(health, source))
        watching_active = starting or own_pid is not None  # a peek of our own also shows as active
        if watching_active and health.exists and health.active_pid is not None and health.active_pid != own_pid:
            raise SlotUnusable(f"replication slot {source.slot!r} is in use by another process (PID "
                               f"{health.active_pid}): another cdc-apply or subscriber reads it. Stop that one, or "
                               "give this pipeline its own source.slot")
        if starting and source.failover and health.failover:
            for name in missing_standby_slots(conn):
                log.warning("synchronized_standby_slots names %r, which does not exist on %s: the server sends slot "
                            "%s nothing until that standby confirms. After a promotion, attach the new standby "
                            "with that slot, or clear the setting until it is (docs/operations.md, \"Failover\")",
                            name, f"{conn.info.host}:{conn.info.port}", source.slot)
        tables = publication_tables(conn, source.publications)
        if tables is None:
            gone = missing_publications(conn, source.publications)
            raise SlotUnusable(f"publication {gone[0]!r} no longer exists: no change can be decoded. "
                               f"Recover: CREATE PUBLICATION {gone[0]} ... again (or set "
                               "source.create_publication: true), then `cdc-apply resync --config <file> --all`, "
                               "since changes made without it were not sent")
        if self.tables is not None:
            for oid in sorted(self.tables.keys() - tables.keys()):
                log.warning("table %s left publication %s: its target no longer receives changes. To follow it "
                            "again: ALTER PUBLICATION %s ADD TABLE %s, then `cdc-apply resync --table %s`",
                            self.tables[oid], ", ".join(source.publications), source.publications[0],
                            self.tables[oid], self.tables[oid])
        self.tables = tables
        self._check_retained(health)
        return health

    def _check_retained(self, health: SlotHealth) -> None:
        limit = self.source.max_retained_wal
        retained = health.retained_wal_bytes
        if limit is None or retained is None or retained <= limit:
            return
        message = (f"replication slot {self.source.slot!r} holds {retained} bytes of WAL back (restart_lsn "
                   f"{health.restart_lsn}, now {health.current_wal_lsn}), more than source.max_retained_wal "
                   f"({int(limit)} bytes)")
        if health.wal_status in ("unreserved", "extended"):
            message += f"; wal_status is {health.wal_status}"
        if health.safe_wal_size is not None:
            message += f"; {health.safe_wal_size} bytes remain before max_slot_wal_keep_size invalidates it"
        if self.source.on_retained_wal == "stop":
            raise SlotUnusable(message + ". Stopped (source.on_retained_wal: stop): the server keeps the WAL until "
                               "the slot is read or dropped")
        log.warning("%s (source.on_retained_wal: warn)", message)

