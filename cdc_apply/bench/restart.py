"""`cdc-apply bench restart`: how long a restarted pipeline takes to apply its first new change,
from the process start, with the CLI's settings (what a user waits after a deploy, a crash or a
failover).

One server, the load's tables (``bench/load.py``) copied by a first `run --follow` that is then
stopped. Each round: a transaction is committed while nothing runs, a new `cdc-apply run --follow`
(or `stream`) process is started, and the round ends when that transaction's row is in the target
(read by delta-rs every 50 ms). Reported per round: the process start to its "streaming" log line, and to
the change applied; then the median and range over the rounds.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from cdc_apply.bench.crash import READY, SLOT, Job, crash_config, ledger_seqs
from cdc_apply.bench.load import create_schema
from cdc_apply.pgserver import PgServer

POLL_S = 0.05


def _restart_round(conn: psycopg.Connection, config: Path, log: Path, warehouse: str, mode: str,
                   round_number: int) -> tuple[float, float]:
    """(seconds to the streaming line, seconds to the change applied) of one restarted process."""
    seq = conn.execute("INSERT INTO ledger (session, account, amount) VALUES (99, %s, 1) RETURNING seq",
                       (round_number,)).fetchone()[0]
    started = time.monotonic()
    verb = ("stream",) if mode == "stream" else None
    job = Job(config, log, verb=verb, ready=READY[mode])
    streaming_at: float | None = None
    try:
        while True:
            if streaming_at is None and job.streaming.is_set():
                streaming_at = time.monotonic() - started
            if seq in ledger_seqs(warehouse):
                break
            if job.process.poll() is not None:
                raise RuntimeError(f"the restarted job exited {job.process.returncode}\n{job.tail()}")
            if time.monotonic() - started > 300:
                raise TimeoutError(f"the restarted job applied nothing in 300 s\n{job.tail()}")
            time.sleep(POLL_S)
        applied = time.monotonic() - started
    finally:
        job.process.send_signal(signal.SIGTERM)
        job.wait(timeout=120)
    return streaming_at if streaming_at is not None else applied, applied


def _rounds(rounds: int, mode: str, spark_conf: dict[str, str] | None) -> tuple[list[float], list[float]]:
    """(seconds to streaming, seconds to the change applied) of each restart, on a server of its own."""
    with PgServer() as server, tempfile.TemporaryDirectory(prefix="cdc_apply_restart_") as directory:
        config, warehouse, log = crash_config(Path(directory), server.dsn, mode, cli_settings=True,
                                              spark_conf=spark_conf)
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            create_schema(conn, "load")
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
            conn.execute("INSERT INTO accounts VALUES (1, 'first', 1, NULL, now())")
            _restart_round(conn, config, log, warehouse, mode, 0)  # the first run copies the tables
            times = [_restart_round(conn, config, log, warehouse, mode, r) for r in range(1, rounds + 1)]
    return [t[0] for t in times], [t[1] for t in times]


def _report(label: str, rounds: int, streaming: list[float], applied: list[float]) -> None:
    print(f"{label} ({rounds} restarts, each applying one new transaction):")
    print(f"  process start -> streaming: median {statistics.median(streaming):.2f} s "
          f"({min(streaming):.2f}-{max(streaming):.2f})")
    print(f"  process start -> first new change applied: median {statistics.median(applied):.2f} s "
          f"({min(applied):.2f}-{max(applied):.2f}); goal <= 3 s")


def bench_restart(rounds: int = 5, mode: str = "follow", connect: bool = False,
                  connect_url: str | None = None) -> dict[str, float]:
    """``mode``: ``follow`` (`run --follow`) or ``stream`` (`cdc-apply stream`). ``connect``: also
    the same restarts as Spark Connect clients of a server that stays up, after the classic ones, in
    the same run: the server at ``connect_url``, else one started here."""
    if mode not in READY:
        raise ValueError(f"bench restart: --mode is follow or stream, not {mode!r}")
    print(f"bench restart --mode {mode}: classic sessions ...", flush=True)
    streaming, applied = _rounds(rounds, mode, None)
    _report(f"bench restart --mode {mode}, classic", rounds, streaming, applied)
    result = {"streaming_s": statistics.median(streaming), "applied_s": statistics.median(applied)}
    if connect:
        from cdc_apply.spark.connect_server import ConnectServer

        with contextlib.nullcontext() if connect_url else ConnectServer() as server:
            url = connect_url or server.url
            print(f"bench restart --mode {mode}: Spark Connect clients of {url} ...", flush=True)
            streaming, applied = _rounds(rounds, mode, {"spark.remote": url})
        _report(f"bench restart --mode {mode}, Spark Connect", rounds, streaming, applied)
        result |= {"connect_streaming_s": statistics.median(streaming), "connect_applied_s": statistics.median(applied)}
        print(f"  first new change applied, Connect / classic: {result['connect_applied_s'] / result['applied_s']:.2f}x")
    return result
