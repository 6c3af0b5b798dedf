"""`cdc-apply bench memory`: one large transaction (``--megabytes`` of row data, streamed by the
server while it is still open) through `cdc-apply run --follow` in its own process; reports the
process's peak resident memory (the Python driver; the JVM is its child and reported apart) and
the time until the slot is confirmed past the transaction.

``--updates``: the rows are there first (the job's initial copy), and the transaction updates every
one of them and deletes a tenth. ``--changelog``: the job runs with ``changelog.confirm_after:
changelog``, so the transaction goes to the change log (in pieces) and the targets follow from it;
the time until the targets hold it is reported too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from cdc_apply.bench import scratch_directory
from cdc_apply.lake.state import AppliedPosition, PipelineState
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.slot import wait_until_caught_up

ROW_BYTES = 1000


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def bench_memory(megabytes: float = 1024.0, updates: bool = False, changelog: bool = False) -> dict[str, float]:
    rows = max(1, int(megabytes * 2**20 / ROW_BYTES))
    folder = Path(scratch_directory("cdc_apply_bench_memory_"))
    warehouse = str(folder / "wh")
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE big (id bigint PRIMARY KEY, payload text)")
            conn.execute("CREATE PUBLICATION bench FOR TABLE big")
            if updates:
                conn.execute(f"INSERT INTO big SELECT g, repeat('x', {ROW_BYTES}) FROM generate_series(1, {rows}) g")
        config = folder / "memory.yaml"
        config.write_text(json.dumps({"pipeline": "memory",
                                      "source": {"dsn": server.dsn, "slot": "memory", "publication": "bench"},
                                      "target": {"warehouse": warehouse},
                                      **({"changelog": {"enabled": True, "confirm_after": "changelog"}}
                                         if changelog else {})}))
        log = (folder / "follow.log").open("w")
        job = subprocess.Popen([sys.executable, "-m", "cdc_apply.cli", "run", "--follow", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            while "streaming slot" not in (folder / "follow.log").read_text():  # the copy is done
                if job.poll() is not None:
                    raise RuntimeError(f"run --follow ended early:\n{(folder / 'follow.log').read_text()[-3000:]}")
                time.sleep(0.2)
            baseline = _peak_rss_mb(job.pid)
            what = "updates every row and deletes a tenth of" if updates else "inserts"
            print(f"one transaction that {what} {rows:,} rows x {ROW_BYTES} bytes ({megabytes:g} MB) ...", flush=True)
            with psycopg.connect(server.dsn) as conn:
                if updates:
                    conn.execute(f"UPDATE big SET payload = repeat('y', {ROW_BYTES})")
                    conn.execute("DELETE FROM big WHERE id % 10 = 0")
                else:
                    conn.execute(f"INSERT INTO big SELECT g, repeat('x', {ROW_BYTES}) FROM generate_series(1, {rows}) g")
                before_commit = parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
                conn.commit()
            started = time.perf_counter()
            jvm_peak = 0.0

            def sample_jvm() -> None:
                nonlocal jvm_peak
                jvm_peak = max([jvm_peak, *(_peak_rss_mb(child) for child in _children(job.pid))])

            while True:
                try:
                    wait_until_caught_up(server.dsn, "memory", timeout=5, running=lambda: job.poll() is None)
                    break
                except TimeoutError:
                    sample_jvm()
            confirmed_s = time.perf_counter() - started
            position = AppliedPosition(PipelineState.at(warehouse, "memory"))
            while changelog and (position.read() or 0) <= before_commit:  # the targets follow from the log
                if job.poll() is not None:
                    raise RuntimeError(f"run --follow ended early:\n{(folder / 'follow.log').read_text()[-3000:]}")
                sample_jvm()
                time.sleep(1)
            seconds = time.perf_counter() - started
            sample_jvm()
            peak = _peak_rss_mb(job.pid)
        finally:
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=300)
            log.close()
    # The applier's last log line says how: "public.big: {'I': N} in S s (append in P pieces, columnar)"
    hows = re.findall(r"public\.big: \{[^}]*\} in [0-9.]+ s \(([^)]*)\)", (folder / "follow.log").read_text())
    where = "run --follow, confirm_after: changelog" if changelog else "run --follow"
    print(f"bench memory ({megabytes:g} MB in one streamed transaction of {'updates and deletes' if updates else 'inserts'} "
          f"through {where})")
    if changelog:
        print(f"  slot confirmed (the change log holds it) in {confirmed_s:.1f} s")
    print(f"  applied in {seconds:.1f} s ({hows[-1] if hows else 'how: not logged'})")
    print(f"  peak RSS: Python driver {peak:,.0f} MB (before the transaction {baseline:,.0f} MB; goal < 500 MB), "
          f"JVM {jvm_peak:,.0f} MB")
    return {"peak_rss_mb": peak, "baseline_rss_mb": baseline, "jvm_peak_rss_mb": jvm_peak, "seconds": seconds,
            "confirmed_seconds": confirmed_s}
