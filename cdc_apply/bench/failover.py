"""`cdc-apply bench failover`: how long a failover interrupts `run --follow`, and which part of that
is the pipeline's own. ``FailoverDrill`` is also what the failover test drives.

The set-up (docs/operations.md, "Failover"): two PostgreSQL 17+ servers on fixed ports, a primary
and a physical standby that synchronizes the pipeline's failover slot; ``source.dsn`` lists both
with ``target_session_attrs=read-write``; `run --follow` in a thread; a concurrent load through the
same host list. One failover:

1. the primary fails: kill -9 of its postmaster, an immediate stop (a crash), or a fast stop (a
   planned switchover, which hands the standby all the WAL first);
2. the standby is promoted. It has no standby of its own yet, so ``synchronized_standby_slots`` is
   cleared on it: left naming a slot that does not exist, it would hold back every change;
3. a marker transaction is committed on the new primary, and the drill waits until the pipeline
   has applied it (the slot is confirmed past it, which happens only once it is in Delta);
4. the old primary is rebuilt as the new standby from a fresh base backup, named in
   ``synchronized_standby_slots`` again, and the drill waits until it holds a synchronized copy of
   the slot (persistent, not the temporary one a sync starts with), ready for the next failover.

Reported for each: the failure to the end of the promotion (the server's part), the promotion to
the pipeline's walsender on the new primary (detection, reconnect backoff, slot checks), from
there to the marker applied (decode and one MERGE), and the rebuilt standby's time to a synced slot.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.bench import scratch_directory
from cdc_apply.bench.load import Load, create_schema
from cdc_apply.config import Config, parse_config
from cdc_apply.live import BackgroundReplicator
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgserver import PgServer, available_bindirs

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

FAILURES = ("kill -9", "crash", "switchover")
STANDBY_SLOT = "standby"  # the physical slot of whichever server is the standby
SLOT = "failover_drill"
POLL_S = 0.05


@dataclass
class FailoverTimes:
    how: str
    promotion_s: float  # the failure to the end of `pg_ctl promote`
    reconnect_s: float  # the promotion to the pipeline's walsender on the new primary
    apply_s: float  # from there to the marker transaction applied
    standby_synced_s: float  # the old primary's rebuild (a base backup) to its synchronized copy of the slot

    @property
    def pipeline_s(self) -> float:
        return self.reconnect_s + self.apply_s


def wait_for(what: str, check: Callable[[], bool], timeout: float = 120.0, poll: float = POLL_S) -> None:
    """Poll ``check`` until it holds; TimeoutError naming ``what`` after ``timeout`` seconds."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"failover drill: timed out waiting for {what}")
        time.sleep(poll)


def _query(dsn: str, query: str, *params: object) -> tuple[object, ...] | None:
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(query, params).fetchone()
    except psycopg.OperationalError:
        return None


@dataclass
class FailoverDrill:
    warehouse: str
    spark: SparkSession | None = None  # None: a session is built at start
    status_interval_seconds: float = 1.0
    # Tests only: while waiting for a standby's synced copy, ask the primary for the running-xacts
    # record it otherwise writes every 15 s, so the slot moves past the standby sooner. The bench
    # leaves it off: it reports the time a user waits.
    hurry_standby_sync: bool = False
    servers: list[PgServer] = field(default_factory=list)
    pipeline: BackgroundReplicator | None = None

    @property
    def primary(self) -> PgServer:
        return self.servers[0]

    @property
    def standby(self) -> PgServer:
        return self.servers[1]

    @property
    def dsn(self) -> str:
        """Both servers, as a user lists them: whichever is the primary is found."""
        ports = ",".join(str(server.port) for server in sorted(self.servers, key=lambda s: s.port))
        return f"host=127.0.0.1,127.0.0.1 port={ports} user=postgres dbname=postgres target_session_attrs=read-write"

    def start(self) -> FailoverDrill:
        bindir = available_bindirs()["pg18"]
        self.servers = [PgServer(bindir=bindir).start(), PgServer(bindir=bindir)]
        self.standby.start_standby_of(self.primary, STANDBY_SLOT)
        self._name_the_standby(self.primary)
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            create_schema(conn, "drill")
        if self.spark is None:
            from cdc_apply.spark.session import build_spark_session

            self.spark = build_spark_session(self.config.spark)
        self.pipeline = BackgroundReplicator(self.config, self.spark).start()
        self.pipeline.wait_for_snapshots()
        self._wait_standby_synced()
        return self

    @property
    def config(self) -> Config:
        return parse_config({"pipeline": "drill", "target": {"warehouse": self.warehouse},
                             "source": {"dsn": self.dsn, "slot": SLOT, "publication": "drill",
                                        "status_interval_seconds": self.status_interval_seconds}})

    def fail_over(self, how: str) -> FailoverTimes:
        failed_at = time.monotonic()
        if how == "kill -9":
            self.primary.kill()
        else:
            self.primary.halt("immediate" if how == "crash" else "fast")
        self.standby.promote()
        promoted_at = time.monotonic()
        self.servers.reverse()
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET synchronized_standby_slots")  # no standby yet (step 2)
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("INSERT INTO journal VALUES (-1, 0, 'failover marker')")
            marker = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            wait_for("the pipeline's walsender on the new primary", lambda: conn.execute(
                "SELECT active_pid IS NOT NULL FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)).fetchone()
                == (True,), timeout=180)
            attached_at = time.monotonic()
            wait_for("the marker applied", lambda: self._confirmed(conn) >= marker, timeout=180)
            applied_at = time.monotonic()
        self.standby.rebuild_as_standby_of(self.primary, STANDBY_SLOT)
        self._name_the_standby(self.primary)
        self._wait_standby_synced()
        return FailoverTimes(how, promoted_at - failed_at, attached_at - promoted_at, applied_at - attached_at,
                             time.monotonic() - applied_at)

    def _confirmed(self, conn: psycopg.Connection) -> int:
        row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                           (SLOT,)).fetchone()
        return parse_lsn(row[0]) if row and row[0] else 0

    def _name_the_standby(self, primary: PgServer) -> None:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'")
            conn.execute("SELECT pg_reload_conf()")

    def _wait_standby_synced(self) -> None:
        """Until the standby holds a persistent synchronized copy of the slot."""
        def synced() -> bool:
            if self.hurry_standby_sync:
                _query(self.primary.dsn, "SELECT pg_log_standby_snapshot()")
            return _query(self.standby.dsn, "SELECT synced AND NOT temporary FROM pg_replication_slots "
                          "WHERE slot_name = %s", SLOT) == (True,)

        wait_for("the standby's synchronized slot", synced, timeout=180, poll=0.5)

    def close(self) -> None:
        try:
            if self.pipeline is not None:
                self.pipeline.finish(timeout=120)
        finally:
            for server in self.servers:
                server.stop()

    def __enter__(self) -> FailoverDrill:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def drill_failovers(drill: FailoverDrill, failures: tuple[str, ...] = FAILURES, rate: float = 5.0,
                    check: Callable[[psycopg.Connection], None] | None = None) -> list[FailoverTimes]:
    """Each failure under a load of two sessions at ``rate`` transactions/s each; after each, with the
    load stopped and the pipeline caught up, ``check`` gets a connection to the new primary."""
    assert drill.pipeline is not None
    times = []
    for number, how in enumerate(failures, start=1):
        load = Load(drill.dsn, sessions=2, rate_per_session=rate, big_every=0, seed=number).start()
        time.sleep(1)
        times.append(drill.fail_over(how))
        time.sleep(1)
        load.finish()
        drill.pipeline.wait_caught_up(timeout=180)
        if check is not None:
            with psycopg.connect(drill.primary.dsn, autocommit=True) as conn:
                check(conn)
    return times


def bench_failover(rounds: int = 3, rate: float = 5.0) -> list[FailoverTimes]:
    warehouse = scratch_directory("cdc_apply_bench_failover_")
    failures = tuple(FAILURES[number % len(FAILURES)] for number in range(rounds))
    print(f"failover: {rounds} failovers ({', '.join(failures)}) under 2 sessions x {rate:g} tx/s, "
          "the old primary rebuilt as the standby after each ...", flush=True)
    with FailoverDrill(warehouse) as drill:
        times = drill_failovers(drill, failures, rate)
        assert drill.spark is not None
        drill.spark.stop()
    print_failover_report(times)
    return times


def print_failover_report(times: list[FailoverTimes]) -> None:
    print("bench failover (seconds)")
    print(f"  {'failure':12s} {'promotion':>10s} {'reconnect':>10s} {'apply':>8s} {'pipeline':>9s} {'standby synced':>15s}")
    for t in times:
        print(f"  {t.how:12s} {t.promotion_s:10.2f} {t.reconnect_s:10.2f} {t.apply_s:8.2f} {t.pipeline_s:9.2f} "
              f"{t.standby_synced_s:15.2f}")
    print(f"  median pipeline part {statistics.median(t.pipeline_s for t in times):.2f} s (goal < 10 s beyond the "
          f"promotion); median reconnect {statistics.median(t.reconnect_s for t in times):.2f} s")
