"""Which kind of Spark session the apply runs on: classic (py4j into the driver's JVM) or a Spark
Connect client (gRPC to a server; no SparkContext, no py4j). The apply asks only these two
questions of a session; everything else it does runs on either."""

from __future__ import annotations

import os
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


