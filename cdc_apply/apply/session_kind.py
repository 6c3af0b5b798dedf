"""Which kind of Spark session the apply runs on: classic (py4j into the driver's JVM) or a Spark
Connect client (gRPC to a server; no SparkContext, no py4j). The apply asks only these two
questions of a session; everything else it does runs on either."""

from __future__ import annotations

import atexit
import os
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
        if not _created:
            atexit.register(_stop_created)
        _created.append(created)
        _urls[created.session_id] = url
    return created


SERVER_SQL_CONFS = ("spark.sql.extensions", "spark.sql.catalog.", "spark.sql.warehouse.dir")


def remember_url(spark: SparkSession, url: str) -> None:
    """The Connect server ``spark`` was built against, for ``new_session``."""
    with _lock:
        _urls[spark.session_id] = url


# A Connect session left to the garbage collector at the interpreter's exit can hang it (closing its
# gRPC channel waits for threads that are gone): the sessions made here are stopped while it runs.
_urls: dict[str, str] = {}
_created: list[SparkSession] = []
_lock = threading.Lock()


def _stop_created() -> None:
    with _lock:
        created, _created[:] = list(_created), []
    for session in created:
        try:
            session.stop()
        except Exception:  # noqa: BLE001 - the server may be gone; the process is ending anyway
            pass
