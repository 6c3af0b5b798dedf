"""The spark-submit jobs on local[*] and on a real standalone cluster (a master and a worker started
here from the installed pyspark): `jobs/apply_changes.py` copies on the cluster, then
`jobs/stream_changes.py` streams the changes locally; and the example Airflow DAG, whose task is a
`CdcApplyOperator`, run for real with `dag.test()`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cdc_apply.pgserver import free_port
from tests.conftest import CHILD_JVM_OPTIONS
from tests.delta_oracle import delta_rows, parquet_writers, source_types
from tests.reference_apply import postgres_rows

ROOT = Path(__file__).resolve().parents[1]
SPARK_HOME = Path(__import__("pyspark").__file__).parent
COLUMNS = ["id", "name", "qty"]


def _prepare(conninfo: str, tmp_path: Path, slot: str) -> Path:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS stock (id int PRIMARY KEY, name text, qty int)")
        conn.execute("INSERT INTO stock SELECT g, 'item' || g, g FROM generate_series(1, 200) g ON CONFLICT DO NOTHING")
        conn.execute(f"DROP PUBLICATION IF EXISTS {slot}; CREATE PUBLICATION {slot} FOR TABLE stock")
    config = tmp_path / f"{slot}.yaml"
    config.write_text(json.dumps({"pipeline": slot, "source": {"dsn": conninfo, "slot": slot, "publication": slot},
                                  "target": {"warehouse": str(tmp_path / "wh")},
                                  "snapshot": {"range_pages": 1},  # a page per range: copied by Spark's tasks
                                  "stream": {"trigger": "available_now"}}))  # stream_changes.py: what is there, then ends
    return config


def _changes_then_oracle(spark, conninfo: str, tmp_path: Path, run):  # type: ignore[no-untyped-def]
    """run() once on the initial rows, once on changes; Delta must equal PostgreSQL. Returns both results."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        first = run()
        conn.execute("UPDATE stock SET qty = qty * 2 WHERE id % 3 = 0")
        conn.execute("DELETE FROM stock WHERE id > 190")
        conn.execute("INSERT INTO stock VALUES (500, 'new', 5)")
        second = run()
        truth = postgres_rows(conn, "public.stock", COLUMNS)
        got = delta_rows(spark, str(tmp_path / "wh" / "public" / "stock"), COLUMNS, source_types(conn, "public.stock"))
        assert got == truth and len(got) == 191
    return first, second


def _submit(config: Path, master: str, job: str = "apply_changes.py", *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "PYSPARK_PYTHON": sys.executable}
    return subprocess.run([str(SPARK_HOME / "bin" / "spark-submit"), "--master", master, "--driver-memory", "1g",
                           str(ROOT / "jobs" / job), "--config", str(config), *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _wait_port(port: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.fixture
def standalone_cluster(tmp_path: Path) -> Iterator[str]:
    # The master and worker daemons on the tests' short-job JVM options (the JIT's first tier, the
    # serial collector): 4.7 s of CPU to start both instead of 9.3 s; the jobs' own JVMs are as before.
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_WORKER_DIR": str(tmp_path / "work"), "SPARK_DAEMON_JAVA_OPTS": CHILD_JVM_OPTIONS}
    port = free_port()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    master = subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(free_port())], env=env,
                              stdout=open(tmp_path / "master.log", "w"), stderr=subprocess.STDOUT)
    url = f"spark://127.0.0.1:{port}"
    worker = None
    try:
        _wait_port(port)
        worker = subprocess.Popen([spark_class, "org.apache.spark.deploy.worker.Worker", url, "--cores", "1",
                                   "--memory", "1g", "--webui-port", str(free_port())], env=env,
                                  stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while "Successfully registered with master" not in (tmp_path / "worker.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(0.3)
        yield url
    finally:
        for process in (worker, master):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)


def test_spark_submit_job_on_a_standalone_cluster_then_local(db18, spark, tmp_path, standalone_cluster) -> None:  # type: ignore[no-untyped-def]
    """One YAML config under spark-submit twice: `apply_changes.py --once` makes the initial copy on the
    standalone cluster (its tasks run on the worker), then `stream_changes.py` (the Structured
    Streaming job, trigger available now) applies the changes with ``--master local[2]``."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    config = _prepare(conninfo, tmp_path, "submit")
    submits = iter([(standalone_cluster, "apply_changes.py", "--once"), ("local[2]", "stream_changes.py")])

    def run() -> str:
        result = _submit(config, *next(submits))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    first, second = _changes_then_oracle(spark, conninfo, tmp_path, run)
    assert "snapshot public.stock: 200 rows" in first
    # the stream's micro-batches: the 66 updates, 10 deletes and 1 insert
    assert sum(int(rows) for rows in re.findall(r"^batch \d+: (\d+) change rows", second, re.M)) == 77, second[-2000:]
    worker_log = (tmp_path / "worker.log").read_text()
    assert worker_log.count("Asked to launch executor") == 1  # the copy ran on the cluster's worker, the changes locally
    executor_logs = "".join(path.read_text() for path in (tmp_path / "work").glob("app-*/*/stderr"))
    assert "cdc_apply copy task 0 of public.stock: " in executor_logs and "pages public.stock:0..1" in executor_logs
    # The worker's task wrote the copy's Parquet files itself (pyarrow), not Spark's writer.
    writers = parquet_writers(str(tmp_path / "wh" / "public" / "stock"))
    assert "parquet-cpp-arrow" in writers, writers


def test_airflow_dag_runs_a_batch_and_returns_its_summary(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    config = _prepare(conninfo, tmp_path, "airflow_dag")
    home = tmp_path / "airflow"
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "jobs"), "CDC_APPLY_CONFIG": str(config),
           "PYTHONPATH": str(ROOT)}
    migrate = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, capture_output=True,
                             text=True, timeout=600)
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    script = ("import json\n"
              "from jobs.cdc_apply_dag import dag_object\n"
              "run = dag_object.test()\n"
              "ti = run.get_task_instance('apply_changes')\n"
              "print('STATE', run.state, ti.state)\n"
              "print('XCOM', json.dumps(ti.xcom_pull(task_ids='apply_changes')))\n")

    def run() -> dict:
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                timeout=600, cwd=ROOT)
        assert "STATE success success" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
        return json.loads(result.stdout.split("XCOM ", 1)[1].splitlines()[0])

    first, second = _changes_then_oracle(spark, conninfo, tmp_path, run)
    assert first["snapshots"] == {"public.stock": 200}
    assert second["tables"]["public.stock"] == {"I": 1, "U": 66, "D": 10, "T": 0}
    assert second["confirmed_lsn"] is not None and second["lag_p99_s"] >= second["lag_p50_s"] > 0
