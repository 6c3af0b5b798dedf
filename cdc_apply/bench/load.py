"""A steady, concurrent insert/update/delete load for the live tests, the crash tests and `bench e2e`.

Several sessions, each owning its own key range (so they never wait on each other's rows):
inserts, updates, deletes, key changes, TOAST-sized values, multi-statement transactions, a
rolled-back savepoint, and on session 0 now and then a truncate and a transaction large enough to
be streamed. ``journal`` is an insert-only table (REPLICA IDENTITY NOTHING): a change applied
twice shows up there as a duplicate row, so the oracle catches it.

Every committed transaction inserts one ``ledger`` row; ``Load.ledger_lsns`` maps its ``seq`` to
an LSN at or after the commit, so a test can tell which commits a confirmed position covers.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import psycopg

from cdc_apply.lsn import parse_lsn

SCHEMA = """
CREATE TABLE accounts (id bigint PRIMARY KEY, owner text NOT NULL, balance numeric(12,2), note text,
                       updated timestamptz);
CREATE TABLE ledger (seq bigserial PRIMARY KEY, session int, account bigint, amount numeric(12,2));
CREATE TABLE journal (session int, n bigint, what text);
ALTER TABLE journal REPLICA IDENTITY NOTHING;
CREATE TABLE tags (tag text, weight int);
ALTER TABLE tags REPLICA IDENTITY FULL;
"""
TABLES = {
    "public.accounts": ["id", "owner", "balance", "note", "updated"],
    "public.ledger": ["seq", "session", "account", "amount"],
    "public.journal": ["session", "n", "what"],
    "public.tags": ["tag", "weight"],
}


def create_schema(conn: psycopg.Connection, publication: str) -> None:
    conn.execute(SCHEMA)
    conn.execute(f'CREATE PUBLICATION "{publication}" FOR TABLE accounts, ledger, journal, tags')


@dataclass
class Load:
    conninfo: str
    sessions: int = 3
    rate_per_session: float | None = 50.0  # transactions per second per session; None: as fast as possible
    big_every: int = 200  # session 0: a streamed-size transaction every N transactions (0: never)
    seed: int = 1
    stop: threading.Event = field(default_factory=threading.Event)
    committed: int = 0
    changes: int = 0
    ledger_lsns: dict[int, int] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    reconnects: int = 0
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for session in range(self.sessions):
            thread = threading.Thread(target=self._guarded, args=(session,), name=f"load-{session}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def finish(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join()
        if self.errors:
            raise self.errors[0]

    def _guarded(self, session: int) -> None:
        """A lost connection (the server restarted) is retried; anything else ends the session."""
        while not self.stop.is_set():
            try:
                self._session(session)
            except (psycopg.OperationalError, psycopg.Rollback):
                # A savepoint's Rollback escapes its ``transaction()`` block only when the connection
                # broke under it (psycopg cannot roll back on a dead connection): a lost connection too.
                self.reconnects += 1
                self.stop.wait(0.5)
            except BaseException as exc:  # noqa: BLE001 - reported by finish()
                self.errors.append(exc)
                return

    def _session(self, session: int) -> None:
        rng = random.Random(self.seed * 1000 + session + 100 * self.reconnects)
        # Keys never repeat: sessions < 64, distinct per seed, and a reconnect starts a fresh range.
        base = (self.seed * 64 + session + 1) * 1_000_000_000 + self.reconnects * 10_000_000
        owned: list[int] = []
        next_id = base
        count = self.reconnects * 1_000_000  # journal and tag values stay distinct across reconnects
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("SET logical_decoding_work_mem = '64kB'")
            while not self.stop.is_set():
                began = time.monotonic()
                count += 1
                changes = 0
                with conn.transaction():
                    for _ in range(rng.randint(1, 4)):
                        op = rng.random()
                        if op < 0.35 or len(owned) < 5:
                            next_id += 1
                            conn.execute("INSERT INTO accounts VALUES (%s, %s, %s, NULL, now())",
                                         (next_id, f"owner{rng.randint(1, 99)}", rng.randint(0, 10**6) / 100))
                            owned.append(next_id)
                        elif op < 0.70:
                            conn.execute("UPDATE accounts SET balance = balance + %s, updated = now() WHERE id = %s",
                                         (rng.randint(-500, 500) / 100, rng.choice(owned)))
                        elif op < 0.80:
                            conn.execute("DELETE FROM accounts WHERE id = %s", (owned.pop(rng.randrange(len(owned))),))
                        elif op < 0.88:
                            index = rng.randrange(len(owned))
                            next_id += 1
                            conn.execute("UPDATE accounts SET id = %s WHERE id = %s", (next_id, owned[index]))
                            owned[index] = next_id
                        elif op < 0.93:
                            conn.execute("UPDATE accounts SET note = repeat(md5(%s), 400) WHERE id = %s",
                                         (str(rng.random()), rng.choice(owned)))
                        else:
                            with conn.transaction():  # a savepoint
                                conn.execute("INSERT INTO journal VALUES (%s, %s, 'rolled back')", (session, count))
                                raise psycopg.Rollback()
                        changes += 1
                    conn.execute("INSERT INTO journal VALUES (%s, %s, 'tx')", (session, count))
                    if session == 0:
                        changes += self._session_zero_extras(conn, rng, count)
                    seq = conn.execute("INSERT INTO ledger (session, account, amount) VALUES (%s, %s, %s) "
                                       "RETURNING seq", (session, owned[-1] if owned else None, count)).fetchone()[0]
                lsn = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
                with self._lock:
                    self.committed += 1
                    self.changes += changes + 2
                    self.ledger_lsns[seq] = lsn
                if self.rate_per_session:
                    self.stop.wait(max(0.0, 1 / self.rate_per_session - (time.monotonic() - began)))

    def _session_zero_extras(self, conn: psycopg.Connection, rng: random.Random, count: int) -> int:
        changes = 1
        conn.execute("INSERT INTO tags VALUES (%s, %s)", (f"t{count}", rng.randint(1, 9)))
        if count % 97 == 0:
            conn.execute("TRUNCATE tags")
        if self.big_every and count % self.big_every == 0:
            conn.execute("INSERT INTO journal SELECT 0, g, repeat('x', 50) FROM generate_series(1, 3000) g")
            changes += 3000
        return changes
