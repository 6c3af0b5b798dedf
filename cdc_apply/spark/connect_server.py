"""A Spark Connect server with Delta Lake, for the tests, the benchmarks and a developer's machine.

Spark's own server (``org.apache.spark.sql.connect.service.SparkConnectServer``, in pyspark's jars),
started through pyspark's ``spark-submit`` with the Delta jars and cdc_apply's session defaults.
Its Python workers (the ``pgoutput`` and ``pgcopy`` data sources, ``foreachBatch`` functions) run
this interpreter, so cdc_apply is importable there. A client reaches it at ``url``
(``spark.remote`` in the config, or ``SPARK_REMOTE``).

``cdc-apply connect-server [--port N]`` runs one in the foreground.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cdc_apply.pgserver import free_port, wait_until_listening
from cdc_apply.spark.session import spark_conf

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

# The server keeps Spark's own code generation. Interpreted expressions (the config's ``spark`` section:
# ``spark.sql.codegen.factoryMode: NO_CODEGEN``) halved `bench e2e --connect`'s lag on its small tables
# but made MERGEs into a 10-million-row table 1.5-4.3x slower (docs/spark.md, "The Connect server's settings").


def server_command(port: int, overrides: Mapping[str, str] | None = None) -> list[str]:
    import pyspark

    home = os.path.dirname(os.path.realpath(pyspark.__file__))
    command = [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS]
    confs = {**spark_conf(overrides), "spark.connect.grpc.binding.port": str(port)}
    for key, value in confs.items():
        if key == "spark.driver.extraJavaOptions":
            command += ["--driver-java-options", value]
        else:
            command += ["--conf", f"{key}={value}"]
    return [*command, "spark-internal"]


def server_environment() -> dict[str, str]:
    import pyspark

    home = os.path.dirname(os.path.realpath(pyspark.__file__))
    return {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


@dataclass
class ConnectServer:
    """``overrides``: Spark confs of the server (the config's ``spark`` section: S3A settings,
    ``spark.master``, memory)."""

    overrides: dict[str, str] = field(default_factory=dict)
    port: int = 0
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="cdc-apply-connect-", suffix=".log")[1]))
    _process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> ConnectServer:
        self.port = self.port or free_port()
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(server_command(self.port, self.overrides), env=server_environment(),
                                             stdout=log, stderr=log, start_new_session=True)
        wait_until_listening(self._process, self.port, timeout, "the Spark Connect server", str(self.log))
        return self

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._process = None

    def __enter__(self) -> ConnectServer:
        # ``with ConnectServer(...).start() as server`` must not start a second one: it would find the
        # port taken by the first and listening, so the first would never be stopped (it outlived the
        # notebook's test for the rest of the suite, a JVM with its Python workers)
        return self if self.running() else self.start()

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.stop()
        if kind is None:  # the log is kept only to explain a failure
            self.log.unlink(missing_ok=True)
