"""`cdc-apply bench crash`: kill -9 a pipeline again and again under a concurrent load, restart it
each time, and count what was lost and what was applied twice. The crash tests drive the same
drill with fewer random kills (tests/test_crash.py lists them); this soak keeps the full
count (docs/testing.md, "Crash tests and the crash soak").

Modes, each a child process of `cdc-apply` on a slot named ``crash`` (``bench/load.py``'s tables):
- ``follow``: `run --follow`; first a kill at each stage boundary (``STAGES``, the failpoints), then
  the random kills;
- ``stream``: `stream` (Structured Streaming); first a kill between two tables' commits of a
  micro-batch (its rerun must find the tables that already hold it), then the random kills, half of
  them within a new job's first micro-batch (its MERGEs run in a cold JVM), half later;
- ``changelog``: `run --follow` with ``changelog.confirm_after: changelog``; the random kills.

After every kill: each transaction whose commit the slot's confirmed position covers is durable
(in the targets, or under ``confirm_after: changelog`` in the change log, which also must hold no
change twice); those that are not are counted as lost. At the end a job runs until the slot and
the targets have caught up, and every target is compared with PostgreSQL value by value; the
insert-only ``journal`` table (REPLICA IDENTITY NOTHING) counts what was applied twice.

The confirmed-position checks read Delta with delta-rs (the ``deltalake`` package, the ``bench``
extra): about a second per kill faster than a Spark read of each new version.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.bench.load import TABLES, Load, create_schema
from cdc_apply.bench.store import ObjectStore
from cdc_apply.errors import CdcApplyError
from cdc_apply.lake.location import Location, Storage
from cdc_apply.lake.state import STATE_DIRECTORY
from cdc_apply.lsn import parse_lsn
from cdc_apply.sources.slot import wait_until_caught_up

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

MODES = ("follow", "stream", "changelog")
STAGES = ("after_receive", "after_decode", "between_tables", "before_confirm")
SLOT = "crash"
PIPELINE = "crash"
MODE_FAILPOINTS: dict[str, tuple[str, ...]] = {"follow": STAGES, "stream": ("between_tables",), "changelog": ()}
READY = {"follow": "streaming slot", "stream": "cdc_apply.stream_job: streaming query"}
FIRST_BATCH = "cdc_apply.spark.foreach: batch"
MIN_LOAD_SECONDS = 5.0


class Job:
    """One `cdc-apply` verb as a child process; its output is appended to ``log``, and ``streaming``
    is set once a line holds ``ready``."""

    def __init__(self, config: Path, log: Path, failpoint: str | None = None, once: bool = False,
                 verb: tuple[str, ...] | None = None, ready: str = READY["follow"]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("CDC_APPLY_FAILPOINT", None)
        if failpoint:
            env["CDC_APPLY_FAILPOINT"] = failpoint
        self.log = log
        self.ready = ready
        self.streaming = threading.Event()
        verb = verb or ("run", "--once" if once else "--follow")
        self.process = subprocess.Popen([sys.executable, "-m", "cdc_apply.cli", *verb, "--config", str(config)],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.log.open("a") as out:
            for line in self.process.stdout:
                out.write(line)
                if self.ready in line:
                    self.streaming.set()

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def wait_until_ready(self, timeout: float) -> bool:
        """True once the ready line came; False after ``timeout`` or as soon as the process ended."""
        deadline = time.monotonic() + timeout
        while not self.streaming.wait(timeout=0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                return self.streaming.is_set()
        return True

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


class DrillFailed(CdcApplyError):
    """A job did not do what the drill needs (exit, stream, catch up) in time; the message holds the
    end of the jobs' log."""


def crash_config(directory: Path, conninfo: str, mode: str, cli_settings: bool = False,
                 warehouse: str | None = None, spark_conf: Mapping[str, str] | None = None) -> tuple[Path, str, Path]:
    """(config file, warehouse, jobs' log) of the pipeline ``crash`` on slot ``crash`` in ``mode``;
    ``cli_settings``: every other key at its default, as a user's config would leave it. ``warehouse``:
    another than ``directory/wh`` (an object store's, reached with ``spark_conf``)."""
    warehouse = warehouse or str(directory / "wh")
    config = directory / "crash.yaml"
    # Each job lives seconds before its kill: a JIT that compiles less starts it about a third faster.
    sections: dict[str, object] = {"spark": {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
                                             **(spark_conf or {})}}
    if cli_settings:
        sections = {"spark": dict(spark_conf)} if spark_conf else {}
    elif mode == "stream":
        sections["stream"] = {"interval_seconds": 0.5, "max_changes_per_trigger": 20000}
    else:
        sections["batching"] = {"max_seconds": 0.5, "max_changes": 20000}
    if mode == "changelog" and not cli_settings:
        sections["changelog"] = {"enabled": True, "confirm_after": "changelog"}
    config.write_text(json.dumps({"pipeline": PIPELINE, "source": {"dsn": conninfo, "slot": SLOT, "publication": "load"},
                                  "target": {"warehouse": warehouse}, **sections}))
    return config, warehouse, directory / "jobs.log"


def confirmed_lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (SLOT,)).fetchone()
    return parse_lsn(row[0])


def _delta_rs(location: Location, columns: list[str], storage: Storage) -> pa.Table | None:
    """``columns`` of the Delta table at ``location`` read by delta-rs, or None before its first commit."""
    import pyarrow as pa

    try:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError
    except ImportError as exc:
        raise SystemExit("bench crash reads Delta with delta-rs: pip install 'cdc_apply[bench]'") from exc
    if location.local and not (location.path() / "_delta_log").exists():
        return None
    try:
        table = DeltaTable(storage.delta_rs_uri(location), storage_options=storage.delta_rs_options(location))
    except TableNotFoundError:  # the log's directory made, its first commit not yet
        return None
    return pa.RecordBatchReader.from_stream(table.scan(columns=columns)).read_all()


def ledger_seqs(warehouse: str, storage: Storage | None = None) -> set[int]:
    """The ``seq`` of every ``ledger`` row in Delta."""
    table = _delta_rs(Location.parse(warehouse).child("public", "ledger"), ["seq"], storage or Storage())
    return set() if table is None else set(table.column("seq").to_pylist())


def _covered(conn: psycopg.Connection, load: Load) -> set[int]:
    confirmed = confirmed_lsn(conn)
    return {seq for seq, lsn in dict(load.ledger_lsns).items() if lsn <= confirmed}


def lost_from_targets(conn: psycopg.Connection, load: Load, warehouse: str, storage: Storage) -> list[str]:
    """Problems after a kill: transactions the slot's confirmed position covers that no target holds."""
    missing = _covered(conn, load) - ledger_seqs(warehouse, storage)
    return [f"slot confirmed past {len(missing)} transactions Delta does not hold: {sorted(missing)[:5]}"] \
        if missing else []


def lost_from_the_log(conn: psycopg.Connection, load: Load, warehouse: str, storage: Storage) -> list[str]:
    """Problems after a kill under ``confirm_after: changelog``: covered transactions the change log
    does not hold, and any change the log holds twice."""
    covered = _covered(conn, load)
    rows = _delta_rs(Location.parse(warehouse).child(STATE_DIRECTORY, "changelog"),
                     ["commit_lsn", "xid", "seq", "relation_oid", "table", "op", "new"], storage)
    problems = []
    logged: set[int] = set()
    if rows is not None:
        identities = list(zip(*(rows.column(c).to_pylist() for c in ("commit_lsn", "xid", "seq", "relation_oid"))))
        if len(identities) != len(set(identities)):
            problems.append(f"the change log holds {len(identities) - len(set(identities))} changes twice")
        logged = {int(dict(new)["seq"]) for table, op, new in
                  zip(*(rows.column(c).to_pylist() for c in ("table", "op", "new"))) if table == "ledger" and op == "I"}
    missing = covered - logged
    if missing:
        problems.append(f"slot confirmed past {len(missing)} transactions the change log does not hold: "
                        f"{sorted(missing)[:5]}")
    return problems


Check = Callable[[psycopg.Connection, Load, str, Storage], list[str]]
CHECKS: dict[str, Check] = {"follow": lost_from_targets, "stream": lost_from_targets, "changelog": lost_from_the_log}


@dataclass
class CrashDrill:
    """The drill of one ``mode`` on a database already holding nothing of the load: ``kills`` random
    kills (after the mode's failpoint kills), seeded by ``seed``. ``problems`` collects what a check
    found after a kill (a test asserts it is empty; the bench counts it)."""

    mode: str
    conninfo: str
    directory: Path
    kills: int
    seed: int
    problems: list[str] = field(default_factory=list)
    failpoint_kills: int = 0
    random_kills: int = 0
    load: Load | None = None
    progress: Callable[[str], None] | None = None  # told of each kill (the bench prints it)
    warehouse_uri: str | None = None  # an object store's warehouse instead of directory/wh ...
    spark_conf: Mapping[str, str] = field(default_factory=dict)  # ... and how to reach it
    failpoints: tuple[str, ...] | None = None  # the failpoint kills; None: every one of the mode's

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown crash mode {self.mode!r} (one of {', '.join(MODES)})")
        unknown = set(self.failpoints or ()) - set(MODE_FAILPOINTS[self.mode])
        if unknown:
            raise ValueError(f"{self.mode} has no failpoint {', '.join(sorted(unknown))}")
        self.config, self.warehouse, self.log = crash_config(self.directory, self.conninfo, self.mode,
                                                             warehouse=self.warehouse_uri, spark_conf=self.spark_conf)
        self.storage = Storage.from_spark_conf(self.spark_conf)
        self.check = CHECKS[self.mode]

    def job(self, kill: int = 0, failpoint: str | None = None) -> Job:
        if self.mode == "stream":
            ready = FIRST_BATCH if kill % 2 else READY["stream"]
            return Job(self.config, self.log, failpoint=failpoint, verb=("stream",), ready=ready)
        return Job(self.config, self.log, failpoint=failpoint)

    def window(self, kill: int) -> float:
        """How long after its ready line job number ``kill`` may live. A new `run --follow` job's
        first batch, in a cold JVM, commits its tables 7-18 s after it streams (measured uncontended):
        0-6 s lands mostly in its receive, decode and writes, before a commit; the points after a
        commit come from the failpoints. A stream job's odd kills wait for its first micro-batch and
        land within 4 s of it; the even ones anywhere in its first 25 s."""
        if self.mode == "stream":
            return 4.0 if kill % 2 else 25.0
        return 6.0

    def run(self) -> None:
        """Create the load's schema and the slot, run the kills under the load, then one job until it
        has caught up."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            create_schema(conn, "load")
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
            big_every = 200 if self.mode == "changelog" else 120
            self.load = Load(self.conninfo, sessions=2, rate_per_session=2, big_every=big_every).start()
            load_started = time.monotonic()
            try:
                for failpoint in self._failpoints():
                    code = self.job(failpoint=failpoint).wait(timeout=300)
                    if code != -signal.SIGKILL:
                        raise DrillFailed(f"failpoint {failpoint}: exit {code}\n{self.log.read_text()[-3000:]}")
                    self.failpoint_kills += 1
                    self._check(conn, f"failpoint {failpoint}")
                    self._tell(f"killed at failpoint {failpoint}; {len(self.problems)} problem(s) so far")
                self._kill_at_random_points(conn)
                # A drill with few kills still leaves transactions for the last job to apply.
                time.sleep(max(0.0, MIN_LOAD_SECONDS - (time.monotonic() - load_started)))
            finally:
                self.load.finish()
            self._catch_up(conn)

    def _tell(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what)

    def _failpoints(self) -> tuple[str, ...]:
        if self.failpoints is not None:
            return self.failpoints
        return MODE_FAILPOINTS[self.mode]

    def _check(self, conn: psycopg.Connection, after: str) -> None:
        assert self.load is not None
        self.problems.extend(f"after {after}: {problem}" for problem in self.check(conn, self.load, self.warehouse, self.storage))

    def _kill_at_random_points(self, conn: psycopg.Connection) -> None:
        rng = random.Random(self.seed)
        for kill in range(self.kills):
            job = self.job(kill)
            if not job.wait_until_ready(timeout=180):
                code = job.process.poll()
                job.process.kill()
                raise DrillFailed(f"kill {kill + 1}: the job did not stream within 180 s (exit {code})\n{job.tail()}")
            delay = rng.uniform(0, self.window(kill))
            time.sleep(delay)
            job.process.send_signal(signal.SIGKILL)
            if job.wait(timeout=60) != -signal.SIGKILL:
                raise DrillFailed(f"kill {kill + 1}: the job had ended before it was killed\n{job.tail()}")
            self.random_kills += 1
            self._check(conn, f"random kill {kill + 1}")
            self._tell(f"random kill {kill + 1}/{self.kills}: {delay:.1f} s after the job was ready; "
                       f"{len(self.problems)} problem(s) so far")

    def _catch_up(self, conn: psycopg.Connection) -> None:
        job = self.job(kill=1)
        try:
            if not job.wait_until_ready(timeout=180):
                raise DrillFailed(f"the last job did not stream within 180 s (exit {job.process.poll()})\n{job.tail()}")
            if self.mode == "stream":
                # The query confirms its slot at an offset commit, and an idle one only a WAL segment
                # at a time: the targets holding every committed transaction is the end to wait for.
                self._wait_until_delta_holds_the_ledger(timeout=600)
            else:
                try:
                    wait_until_caught_up(self.conninfo, SLOT, timeout=600, running=lambda: job.process.poll() is None)
                except (RuntimeError, TimeoutError) as exc:
                    raise DrillFailed(f"the last job: {exc}\n{job.tail()}") from None
            if self.mode == "changelog":
                self._wait_until_the_targets_hold_the_log(timeout=600)
        finally:
            job.process.send_signal(signal.SIGTERM)
        code = job.wait(timeout=300)
        if code != 0:
            raise DrillFailed(f"the last job exited {code} after SIGTERM\n{job.tail()}")
        self._check(conn, "the last job")

    def _wait_until_the_targets_hold_the_log(self, timeout: float) -> None:
        from cdc_apply.apply.delta_log import writer_versions
        from cdc_apply.lake.state import AppliedPosition, PipelineState

        log = Location.parse(self.warehouse).child(STATE_DIRECTORY, "changelog")
        log_version = writer_versions(log, self.storage)[f"{PIPELINE}/changelog"].version
        position = AppliedPosition(PipelineState.at(self.warehouse, PIPELINE, self.storage))
        deadline = time.monotonic() + timeout
        while (position.read() or 0) < log_version:
            if time.monotonic() > deadline:
                raise DrillFailed(f"the targets did not catch up with the change log in {timeout} s")
            time.sleep(0.5)

    def _wait_until_delta_holds_the_ledger(self, timeout: float) -> None:
        """SIGTERM then stops the query after its running micro-batch, which writes every table."""
        assert self.load is not None
        deadline = time.monotonic() + timeout
        while not ledger_seqs(self.warehouse, self.storage) >= set(self.load.ledger_lsns):
            if time.monotonic() > deadline:
                raise DrillFailed(f"the targets did not hold every committed transaction in {timeout} s")
            time.sleep(1)

    def reran_a_batch_that_was_partly_written(self) -> bool:
        """A stream job's rerun of the micro-batch killed between its table commits skipped the
        tables it had written (its log line says how many already held it)."""
        return re.search(r"\([1-9]\d* already held it\)", self.log.read_text()) is not None


def load_table_differences(spark: SparkSession, conn: psycopg.Connection, warehouse: str) -> dict[str, tuple[int, int]]:
    """Each load table whose Delta target differs from PostgreSQL, value by value, with (rows in
    Delta, rows in PostgreSQL). Values are compared as PostgreSQL's text, timestamps as
    microseconds since the epoch."""
    from pyspark.sql import functions as F

    differences = {}
    for name, columns in TABLES.items():
        schema, _, table = name.partition(".")
        types = dict(conn.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                                  "attrelid = format('%%I.%%I', %s::text, %s::text)::regclass AND attnum > 0 AND NOT "
                                  "attisdropped", (schema, table)).fetchall())
        select = ", ".join(f'(extract(epoch FROM "{c}") * 1000000)::bigint::text' if types[c].startswith("timestamp")
                           else f'"{c}"::text' for c in columns)
        truth = sorted((tuple(row) for row in conn.execute(f'SELECT {select} FROM "{schema}"."{table}"')), key=repr)
        frame = spark.read.format("delta").load(str(Location.parse(warehouse).child(schema, table)))
        got = sorted((tuple(row) for row in frame.select(*[
            (F.unix_micros(F.col(c)) if types[c].startswith("timestamp") else F.col(c)).cast("string")
            for c in columns]).collect()), key=repr)
        if got != truth:
            differences[name] = (len(got), len(truth))
    return differences


def report(drill: CrashDrill, spark: SparkSession, conn: psycopg.Connection, seconds: float) -> dict[str, int]:
    """Prints and returns what a finished drill found: the kills made, the transactions lost and
    applied twice, the checks after a kill that found the slot past what was durable, and the
    tables that differ from PostgreSQL."""
    assert drill.load is not None
    differences = load_table_differences(spark, conn, drill.warehouse)
    journal_pg = conn.execute("SELECT count(*) FROM journal").fetchone()[0]  # type: ignore[index]
    journal_delta = spark.read.format("delta").load(str(Location.parse(drill.warehouse).child("public", "journal"))).count()
    lost = len(set(drill.load.ledger_lsns) - ledger_seqs(drill.warehouse, drill.storage))
    result = {"failpoint_kills": drill.failpoint_kills, "random_kills": drill.random_kills,
              "committed": drill.load.committed, "lost": lost, "applied_twice": max(0, journal_delta - journal_pg),
              "problems_after_kills": len(drill.problems), "tables_differing": len(differences)}
    print(f"bench crash --mode {drill.mode} (seed {drill.seed}), {seconds:.0f} s:")
    print(f"  kills: {drill.failpoint_kills} at failpoints + {drill.random_kills} at random points; "
          f"{drill.load.committed} transactions committed under the load")
    print(f"  lost: {lost}; applied twice (journal rows over PostgreSQL's): {result['applied_twice']}")
    print(f"  slot confirmed past what was durable, after a kill: {len(drill.problems)}")
    for problem in drill.problems[:10]:
        print(f"    {problem}")
    print(f"  tables equal to PostgreSQL: {len(TABLES) - len(differences)} of {len(TABLES)}"
          + "".join(f"; {name}: {d} rows in Delta, {p} in PostgreSQL" for name, (d, p) in differences.items()))
    return result


def bench_crash(mode: str, kills: int = 20, seed: int = 7, spark: SparkSession | None = None,
                store: ObjectStore | None = None) -> dict[str, int]:
    """The drill on a throwaway server; prints and returns its ``report``. ``store``: the warehouse on
    that object store instead of the local disk."""
    from cdc_apply.pgserver import PgServer
    from cdc_apply.spark.session import session_for

    started = time.monotonic()
    with PgServer() as server, tempfile.TemporaryDirectory(prefix="cdc_apply_crash_") as directory:
        drill = CrashDrill(mode, server.dsn, Path(directory), kills=kills, seed=seed,
                           progress=lambda what: print(f"  {what}", flush=True),
                           warehouse_uri=store.under("crash") if store else None,
                           spark_conf=store.spark_conf if store else {})
        print(f"bench crash --mode {mode}: {kills} random kills (seed {seed}) under 2 sessions x 2 tx/s, the "
              f"warehouse at {drill.warehouse} ...", flush=True)
        drill.run()
        with session_for(spark, drill.spark_conf) as spark, psycopg.connect(server.dsn, autocommit=True) as conn:
            return report(drill, spark, conn, time.monotonic() - started)
