"""Crash safety of `cdc-apply run --follow`: kill -9 at each stage boundary and at 20 random points
under a concurrent load, restart each time; at the end Delta equals PostgreSQL (nothing lost, and
the insert-only ``journal`` table shows nothing applied twice).

After every kill: each transaction whose commit the slot's confirmed position covers is in Delta
(``confirmed_flush_lsn`` never passes what Delta holds).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_apply.bench.load import Load, create_schema
from cdc_apply.lsn import parse_lsn
from cdc_apply.sources.slot import wait_until_caught_up
from tests.test_live import assert_delta_equals_postgres

STAGES = ["after_receive", "after_decode", "between_tables", "before_confirm"]
RANDOM_KILLS = 20


class Job:
    """`cdc-apply run --follow` (or ``--once``) as a child process; its output goes to a log file."""

    def __init__(self, config: Path, log: Path, failpoint: str | None = None, once: bool = False,
                 verb: tuple[str, ...] | None = None, ready: str = "streaming slot") -> None:
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


def _confirmed(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'crash'").fetchone()
    return parse_lsn(row[0])


def _assert_confirmed_is_durable(conn: psycopg.Connection, load: Load, warehouse: str) -> None:
    """Read by delta-rs: a second Delta reader, and ~1 s faster per kill than a Spark read that
    rebuilds the table state of every new version."""
    confirmed = _confirmed(conn)
    covered = {seq for seq, lsn in dict(load.ledger_lsns).items() if lsn <= confirmed}
    missing = covered - ledger_seqs(warehouse)
    assert not missing, f"slot confirmed past {len(missing)} transactions Delta does not hold: {sorted(missing)[:5]}"


def ledger_seqs(warehouse: str) -> set[int]:
    """The ``seq`` of every ``ledger`` row in Delta, read by delta-rs."""
    path = Path(warehouse) / "public" / "ledger"
    if not (path / "_delta_log").exists():
        return set()
    return set(pa.RecordBatchReader.from_stream(DeltaTable(str(path)).scan(columns=["seq"])).read_all()
               .column("seq").to_pylist())


def crash_config(tmp_path: Path, conninfo: str, **sections: object) -> tuple[Path, str, Path]:
    """(config file, warehouse, job log) of a pipeline named ``crash`` on slot ``crash``."""
    warehouse = str(tmp_path / "wh")
    config = tmp_path / "crash.yaml"
    # Each job lives seconds before its kill: a JIT that compiles less starts it about a third faster.
    spark = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}
    config.write_text(json.dumps({"pipeline": "crash", "source": {"dsn": conninfo, "slot": "crash", "publication": "load"},
                                  "target": {"warehouse": warehouse}, "spark": spark, **sections}))
    return config, warehouse, tmp_path / "jobs.log"


def kill_at_random_points(conn: psycopg.Connection, load: Load, warehouse: str, new_job: Callable[[int], Job],
                          rng: random.Random,
                          check: Callable[[psycopg.Connection, Load, str], None] = _assert_confirmed_is_durable,
                          window: Callable[[int], float] = lambda kill: 6.0, kills: int = RANDOM_KILLS) -> None:
    """``kills`` times: start job number ``kill``, SIGKILL it at a random moment within
    ``window(kill)`` seconds of its ready line, ``check`` the slot against Delta."""
    for kill in range(kills):
        job = new_job(kill)
        assert job.streaming.wait(timeout=180), job.log.read_text()[-3000:]
        # A new job's first batch, in a cold JVM, commits its tables 7-18 s after it streams (measured
        # uncontended; its tables are written at once): 0-6 s lands mostly in its receive, decode and
        # writes, before a commit. The points after a commit come from the failpoints (``STAGES``) or
        # a wider ``window`` (the streaming test's).
        time.sleep(rng.uniform(0, window(kill)))
        job.process.send_signal(signal.SIGKILL)
        assert job.wait(timeout=60) == -signal.SIGKILL
        check(conn, load, warehouse)


@pytest.mark.timeout(2400)
def test_kill_9_at_stage_boundaries_and_random_points(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    config, warehouse, log = crash_config(tmp_path, conninfo, batching={"max_seconds": 0.5, "max_changes": 20000})
    rng = random.Random(7)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute("SELECT pg_create_logical_replication_slot('crash', 'pgoutput')")
        load = Load(conninfo, sessions=2, rate_per_session=2, big_every=120).start()
        try:
            for stage in STAGES:
                job = Job(config, log, failpoint=stage)
                code = job.wait(timeout=300)
                assert code == -signal.SIGKILL, f"failpoint {stage}: exit {code}\n{log.read_text()[-3000:]}"
                _assert_confirmed_is_durable(conn, load, warehouse)
            kill_at_random_points(conn, load, warehouse, lambda kill: Job(config, log), rng)
        finally:
            load.finish()
        job = Job(config, log)
        try:
            wait_until_caught_up(conninfo, "crash", timeout=600)
        finally:
            job.process.send_signal(signal.SIGTERM)
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert load.committed > 200
        assert_delta_equals_postgres(spark, conn, warehouse)
