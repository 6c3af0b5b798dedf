"""Which kind of Spark session the apply runs on: classic (py4j into the driver's JVM) or a Spark
Connect client (gRPC to a server; no SparkContext, no py4j). The apply asks only these two
questions of a session; everything else it does runs on either."""

from __future__ import annotations

import atexit
import os
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect client session (no py4j, no SparkContext)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark: SparkSession) -> int:
    """How many tasks the cluster runs at once: the SparkContext's figure on a classic session; on
    Connect, ``spark.default.parallelism`` when the session sees it, else the cores of a
    ``local[N]`` master, else ``spark.sql.shuffle.partitions``."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    configured = spark.conf.get("spark.default.parallelism", None)
    if configured:
        return int(configured)
    master = spark.conf.get("spark.master", None) or ""
    if master.startswith("local["):
        cores = master[len("local["):].split(",")[0].rstrip("]")
        return (os.cpu_count() or 1) if cores == "*" else int(cores)
    return int(spark.conf.get("spark.sql.shuffle.partitions", "2") or 2)




def new_session(spark: SparkSession) -> SparkSession:
    """A session of its own (its own confs and temporary views) on the same cluster, with the same
    confs: a thread that sets commit confs must not share them with another thread's commits. On
    Spark Connect, a new server-side session through the public builder, at the URL its first
    session was built with (``remember_url``) or, in a server's foreachBatch worker, Spark's own."""
    if not is_connect(spark):
        return spark.newSession()
    from pyspark.sql import SparkSession as Builder

    url = _urls.get(spark.session_id) or os.environ.get("SPARK_CONNECT_LOCAL_URL") or os.environ.get("SPARK_REMOTE")
    if not url:
        raise RuntimeError("a second Spark Connect session is needed, but the server's URL is unknown: "
                           "set spark.remote in the config or SPARK_REMOTE")
    builder = Builder.builder.remote(url)
    for key, value in spark.conf.getAll.items():  # type: ignore[attr-defined]
        # SQL and Delta confs: what a session may set (the rest is the server's configuration)
        if key.startswith(("spark.sql.", "spark.databricks.")) and not key.startswith(SERVER_SQL_CONFS):
            builder = builder.config(key, value)
    created = builder.create()
    with _lock:
        _urls[created.session_id] = url
    _close_at_exit(created, created=True)
    return created


# The SQL confs a Connect server owns (static ones): never sent by a client session, here or in
# spark/session.py's SERVER_DECIDES, which adds the server's other settings to these.
SERVER_SQL_CONFS = ("spark.sql.extensions", "spark.sql.catalog.", "spark.sql.warehouse.dir", "spark.sql.codegen.cache.")


def remember_url(spark: SparkSession, url: str) -> None:
    """The Connect server ``spark`` was built against, for ``new_session``."""
    with _lock:
        _urls[spark.session_id] = url
    _close_at_exit(spark)


# At the interpreter's exit, pyspark releases each Connect session on its server, retrying for
# minutes while the server does not answer: a process whose server had stopped or died (a bench after
# its server, a pipeline after a failover of it) hung about ten minutes before it exited. So the
# sessions built here are closed first (atexit runs the handlers registered last first): stopped
# while their server listens, their channels closed without a call while it does not. A session
# left to the garbage collector could hang the exit too (closing its channel waits for threads that
# are gone).
_urls: dict[str, str] = {}
_lock = threading.Lock()


def _close_at_exit(spark: SparkSession, created: bool = False) -> None:
    """``created``: made by ``new_session``, so stopped here at exit; the others are the caller's."""
    atexit.register(_close, spark, created)


def _close(spark: SparkSession, created: bool) -> None:
    with _lock:
        url = _urls.get(spark.session_id)
    client = spark.client  # type: ignore[attr-defined]
    if client.is_closed:
        return
    try:
        if url is not None and not _listens_at_exit(url):
            client.close()  # no call to a server that is gone; pyspark's own exit handler skips it then
        elif created:
            spark.stop()
    except Exception:  # noqa: BLE001 - the process is ending anyway
        pass


def _listens_at_exit(url: str) -> bool:
    """``server_listens``, asked once per server at exit (a server that drops packets costs a timeout)."""
    if url not in _listening:
        _listening[url] = server_listens(url)
    return _listening[url]


_listening: dict[str, bool] = {}


def server_listens(url: str, timeout: float = 1.0) -> bool:
    """Whether the Spark Connect server at ``url`` (``sc://host:port/;params``) accepts a connection."""
    address = url.removeprefix("sc://").split("/", 1)[0].split(";", 1)[0]
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "15002")
    try:
        socket.create_connection((host.strip("[]") or "localhost", int(port or 15002)), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True
