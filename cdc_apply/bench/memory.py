"""`cdc-apply bench memory`: one large transaction (``--megabytes`` of row data, streamed by the
server while it is still open) through `cdc-apply run --follow` in its own process; reports the
process's peak resident memory (the Python driver; the JVM is its child and reported apart) and
the time until the slot is confirmed past the transaction.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

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


def bench_memory(megabytes: float = 1024.0) -> dict[str, float]:
    rows = max(1, int(megabytes * 2**20 / ROW_BYTES))
    folder = Path(tempfile.mkdtemp(prefix="cdc_apply_bench_memory_"))
    with PgServer() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE big (id bigint PRIMARY KEY, payload text)")
            conn.execute("CREATE PUBLICATION bench FOR TABLE big")
        config = folder / "memory.yaml"
        config.write_text(json.dumps({"pipeline": "memory",
                                      "source": {"dsn": server.dsn, "slot": "memory", "publication": "bench"},
                                      "target": {"warehouse": str(folder / "wh")}}))
        log = (folder / "follow.log").open("w")
        job = subprocess.Popen([sys.executable, "-m", "cdc_apply.cli", "run", "--follow", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            while "streaming slot" not in (folder / "follow.log").read_text():  # the (empty) copy is done
                if job.poll() is not None:
                    raise RuntimeError(f"run --follow ended early:\n{(folder / 'follow.log').read_text()[-3000:]}")
                time.sleep(0.2)
            baseline = _peak_rss_mb(job.pid)
            print(f"one transaction of {rows:,} rows x {ROW_BYTES} bytes ({megabytes:g} MB) ...", flush=True)
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                conn.execute(f"INSERT INTO big SELECT g, repeat('x', {ROW_BYTES}) FROM generate_series(1, {rows}) g")
            started = time.perf_counter()
            jvm_peak = 0.0
            while True:
                try:
                    wait_until_caught_up(server.dsn, "memory", timeout=5, running=lambda: job.poll() is None)
                    break
                except TimeoutError:
                    jvm_peak = max([jvm_peak, *(_peak_rss_mb(child) for child in _children(job.pid))])
            seconds = time.perf_counter() - started
            jvm_peak = max([jvm_peak, *(_peak_rss_mb(child) for child in _children(job.pid))])
            peak = _peak_rss_mb(job.pid)
        finally:
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=300)
            log.close()
    # The applier's log line says how: "public.big: {'I': N} in S s (append in P pieces, columnar)"
    how = re.search(r"public\.big: \{[^}]*\} in [0-9.]+ s \(([^)]*)\)", (folder / "follow.log").read_text())
    print(f"bench memory ({megabytes:g} MB in one streamed transaction through run --follow)")
    print(f"  applied in {seconds:.1f} s ({how[1] if how else 'how: not logged'})")
    print(f"  peak RSS: Python driver {peak:,.0f} MB (before the transaction {baseline:,.0f} MB; goal < 500 MB), "
          f"JVM {jvm_peak:,.0f} MB")
    return {"peak_rss_mb": peak, "baseline_rss_mb": baseline, "jvm_peak_rss_mb": jvm_peak, "seconds": seconds}
