"""The Spark session with Delta Lake, as every part of cdc_apply uses it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_apply.apply.session_kind import SERVER_SQL_CONFS, remember_url
from cdc_apply.spark.jars import resolve_jars
from cdc_apply.spark.jvm import driver_java_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Defaults tuned for a small local machine; every key can be overridden from config.
DEFAULT_SPARK_CONF: dict[str, str] = {
    "spark.master": "local[*]",
    "spark.app.name": "cdc_apply",
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    "spark.databricks.delta.properties.defaults.enableDeletionVectors": "true",
    # Delta checkpoints every 10th commit, in the committing thread: with small commits that is one
    # batch in ten taking twice as long, which was the lag's p99 (docs/live.md, "Speed").
    "spark.databricks.delta.properties.defaults.checkpointInterval": "50",
    # Delta rebuilds snapshots with 50 partitions by default: far too many for small batches.
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.shuffle.partitions": "2",
    # Spark keeps 100 compiled generated classes, keyed by class loader as well as code (SPARK-44795).
    # On a Connect server every session has a class loader of its own, so four tables' sessions
    # evicted each other's classes and their tasks compiled them again, commit after commit: about
    # 1.3x the server's CPU per append (docs/spark.md, "Per-command cost on the Connect server").
    # A static conf: the server's, never a client session's.
    "spark.sql.codegen.cache.maxEntries": "1000",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "4g",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


# Decided by spark-submit when it started the driver: not overridden unless the config says so.
SUBMIT_DECIDES = ("spark.master", "spark.app.name", "spark.driver.memory", "spark.driver.extraJavaOptions")


def launched_by_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_conf(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    defaults = dict(DEFAULT_SPARK_CONF)
    if launched_by_spark_submit():
        for key in SUBMIT_DECIDES:
            defaults.pop(key, None)
    conf = {**defaults, **(overrides or {})}
    jars = [str(p) for p in resolve_jars()]
    if not launched_by_spark_submit():
        conf["spark.driver.extraJavaOptions"] = driver_java_options(conf.get("spark.driver.extraJavaOptions"))
    extra = conf.get("spark.jars")
    conf["spark.jars"] = ",".join(jars + ([extra] if extra else []))
    return conf


def build_spark_session(overrides: Mapping[str, str] | None = None, *, register_pgoutput: bool = True) -> SparkSession:
    """A Spark session with Delta configured from the cached jars, UTC, quiet logs, and the
    ``pgoutput`` data source registered.

    ``overrides`` is the ``spark`` section of the config: any Spark conf, including ``spark.master``.
    ``register_pgoutput=False`` leaves the data source out (the CLI's verbs and the jobs): the first Python data
    source a session registers makes Spark look for installed ones in a new Python worker, about 2 s
    of a job's start. Code that reads ``format("pgoutput")`` or ``format("pgcopy")`` registers it
    itself before it reads (registering it again is quiet and cheap).
    """
    from pyspark.sql import SparkSession

    remote = connect_url(overrides)
    if remote is not None:
        return _connect_session(remote, overrides or {}, register_pgoutput)
    if launched_by_spark_submit():
        _add_jars_to_driver(resolve_jars())
    # Python workers (the pgoutput data source) must run this interpreter, the one with cdc_apply.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder
    for key, value in spark_conf(overrides).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    if register_pgoutput:
        from cdc_apply.spark import datasource

        datasource.register(spark)
    return spark


def connect_url(overrides: Mapping[str, str] | None = None) -> str | None:
    """The Spark Connect server the config's ``spark.remote`` (or ``SPARK_REMOTE``) names, else None."""
    return (overrides or {}).get("spark.remote") or os.environ.get("SPARK_REMOTE") or None


# Set by the Connect server's own configuration, never by a client session (docs/spark.md).
SERVER_DECIDES = ("spark.master", "spark.app.name", "spark.jars", "spark.driver.", "spark.executor.", "spark.ui.",
                  "spark.remote", "spark.hadoop.") + SERVER_SQL_CONFS


def connect_session_conf(overrides: Mapping[str, str]) -> dict[str, str]:
    """What a Connect client session sets of cdc_apply's defaults and the config's ``spark`` keys."""
    return {key: value for key, value in {**DEFAULT_SPARK_CONF, **overrides}.items() if not key.startswith(SERVER_DECIDES)}


def _connect_session(url: str, overrides: Mapping[str, str], register_pgoutput: bool) -> SparkSession:
    """A Spark Connect client session: cdc_apply's session defaults and the config's ``spark`` keys
    that a session may set (SQL and Delta confs); the rest is the server's configuration."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(url)
    for key, value in connect_session_conf(overrides).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    remember_url(spark, url)
    if register_pgoutput:
        from cdc_apply.spark import datasource

        datasource.register(spark)
    return spark


@contextmanager
def session_for(spark: SparkSession | None, overrides: Mapping[str, str] | None = None) -> Iterator[SparkSession]:
    """``spark`` when the caller has one (left running: a test's shared session), else a new
    session (``build_spark_session(overrides)``), stopped at the end."""
    if spark is not None:
        yield spark
        return
    session = build_spark_session(overrides)
    try:
        yield session
    finally:
        session.stop()


def _add_jars_to_driver(jars: list[Path]) -> None:
    """Under spark-submit the driver JVM is already running: put the Delta jars on its class loader
    (spark-submit's is a MutableURLClassLoader) before the session loads Delta's extension."""
    from pyspark import SparkContext

    SparkContext._ensure_initialized()  # type: ignore[attr-defined]
    jvm = SparkContext._jvm  # type: ignore[attr-defined]
    loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    for jar in jars:
        loader.addURL(jvm.java.io.File(str(jar)).toURI().toURL())
