"""The SQL interface to a pgoutput slot: create it, peek or get its changes, advance it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from cdc_apply.lsn import format_lsn, parse_lsn
from cdc_apply.sources.raw import RawMessage


def quote_publication_names(names: Sequence[str]) -> str:
    """publication_names is parsed as an identifier list: quote each name the way SQL does."""
    return ",".join('"' + name.replace('"', '""') + '"' for name in names)


@dataclass(frozen=True)
class PgOutputOptions:
    publications: tuple[str, ...]
    proto_version: int = 1
    binary: bool = False
    messages: bool = True
    streaming: str | None = None  # None, "on", "off" or "parallel" (protocol 4)
    two_phase: bool = False  # a slot property for the SQL interface; an option for the walsender
    origin: str | None = None  # "any" or "none" (PostgreSQL 16+)
    extra: Mapping[str, str] = field(default_factory=dict)

    def as_pairs(self, for_walsender: bool = False) -> list[tuple[str, str]]:
        pairs = [("proto_version", str(self.proto_version)),
                 ("publication_names", quote_publication_names(self.publications)),
                 ("binary", str(self.binary).lower()),
                 ("messages", str(self.messages).lower())]
        if self.streaming is not None:
            pairs.append(("streaming", self.streaming))
        if self.two_phase and for_walsender:
            pairs.append(("two_phase", "true"))
        if self.origin is not None:
            pairs.append(("origin", self.origin))
        pairs.extend(self.extra.items())
        return pairs


FAILOVER_SLOTS_VERSION = 170000  # failover slots and their synchronization to standbys


def create_slot(conn: psycopg.Connection, slot: str, *, two_phase: bool = False, temporary: bool = False,
                failover: bool = False) -> int:
    """Create a pgoutput slot; returns its consistent point LSN. ``failover`` needs PostgreSQL 17+."""
    if failover:
        row = conn.execute("SELECT lsn FROM pg_create_logical_replication_slot(%s, 'pgoutput', %s, %s, true)",
                           (slot, temporary, two_phase)).fetchone()
    else:
        row = conn.execute("SELECT lsn FROM pg_create_logical_replication_slot(%s, 'pgoutput', %s, %s)",
                           (slot, temporary, two_phase)).fetchone()
    assert row is not None
    return parse_lsn(row[0])


def _changes_query(function: str, options: PgOutputOptions) -> tuple[sql.Composed, list[object]]:
    params: list[object] = []
    option_sql = []
    for key, value in options.as_pairs():
        option_sql.append(sql.SQL("%s, %s"))
        params += [key, value]
    query = sql.SQL("SELECT lsn::text, xid::text::bigint, data FROM {}(%s, %s, %s{}{})").format(
        sql.Identifier(function),
        sql.SQL(", ") if option_sql else sql.SQL(""),
        sql.SQL(", ").join(option_sql),
    )
    return query, params


def read_changes(conn: psycopg.Connection, slot: str, options: PgOutputOptions, *, consume: bool = False,
                 upto_lsn: int | None = None, upto_nchanges: int | None = None) -> Iterator[RawMessage]:
    """Rows of pg_logical_slot_{peek,get}_binary_changes as RawMessages."""
    function = "pg_logical_slot_get_binary_changes" if consume else "pg_logical_slot_peek_binary_changes"
    query, params = _changes_query(function, options)
    args = [slot, None if upto_lsn is None else format_lsn(upto_lsn), upto_nchanges, *params]
    with conn.cursor(binary=False) as cur:
        cur.execute(query, args)
        for lsn_text, xid, data in cur:
            yield RawMessage(parse_lsn(lsn_text), xid, bytes(data), f"slot {slot}")


def advance_slot(conn: psycopg.Connection, slot: str, lsn: int) -> None:
    conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, format_lsn(lsn)))


def drop_slot(conn: psycopg.Connection, slot: str) -> None:
    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


# Why a missing slot is never created again silently, and the way back: every refusal ends with it.
SLOT_GONE = ("a failover to a server without a synced copy of the slot, or the slot was dropped: a new slot would "
             "start now and miss every change since. Recover: `cdc-apply resync --config <file> --all` creates the "
             "slot and copies every table again (docs/operations.md, \"Failover\")")


def slot_exists(conn: psycopg.Connection, slot: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone() is not None


def release_stalled_reader(conn: psycopg.Connection, slot: str, backend_pid: int) -> bool:
    """End ``backend_pid`` if it still holds ``slot``: the walsender of a connection this process gave
    up as stalled. The server would end it only after ``wal_sender_timeout``, and until then the
    slot cannot be read again. True when it was ended."""
    row = conn.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                       "WHERE slot_name = %s AND active_pid = %s", (slot, backend_pid)).fetchone()
    return bool(row and row[0])


def server_version_num(conn: psycopg.Connection) -> int:
    return int(conn.info.server_version)


def current_wal_lsn(conn: psycopg.Connection) -> int:
    return parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]


def confirmed_flush(conn: psycopg.Connection, slot: str) -> int:
    """The slot's confirmed_flush_lsn (0 when the slot does not exist or has none yet)."""
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return parse_lsn(row[0]) if row and row[0] else 0


def wait_until_caught_up(conninfo: str, slot: str, timeout: float = 120.0,
                         running: Callable[[], bool] = lambda: True, lsn: int | None = None) -> None:
    """Until the slot's confirmed position reaches ``lsn``, by default the WAL position at the time of
    the call. ``running``: whether whatever confirms the slot is still at work (no use waiting once
    it stopped)."""
    import time

    with psycopg.connect(conninfo, autocommit=True) as conn:
        target = current_wal_lsn(conn) if lsn is None else lsn
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if confirmed_flush(conn, slot) >= target:
                return
            if not running():
                raise RuntimeError(f"slot {slot}: the pipeline stopped before it caught up")
            time.sleep(0.2)
    raise TimeoutError(f"slot {slot} did not reach the WAL position within {timeout} s")
