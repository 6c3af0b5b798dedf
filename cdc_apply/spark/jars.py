"""Delta Lake jars: resolved from Maven Central once, then loaded from a local cache.

The first call resolves ``io.delta:delta-spark_<spark>_<scala>:<delta>`` and its dependencies
through Spark's own Ivy into the cache directory. Later sessions pass the cached files as
``spark.jars``, so they start without Ivy and without network.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

SCALA_VERSION = "2.13"


def delta_coordinate() -> str:
    import pyspark

    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    return f"io.delta:delta-spark_{spark_minor}_{SCALA_VERSION}:{metadata.version('delta_spark')}"


def cache_dir() -> Path:
    configured = os.environ.get("CDC_APPLY_JAR_CACHE")
    base = Path(configured) if configured else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    if not configured:
        base = base / "cdc_apply" / "jars"
    return base / delta_coordinate().replace(":", "_")


def _manifest_path() -> Path:
    return cache_dir() / "jars.json"


def cached_jars() -> list[Path] | None:
    """The cached jar files, or None when they have not been resolved (or were removed)."""
    try:
        listed = [Path(p) for p in json.loads(_manifest_path().read_text())["jars"]]
    except (OSError, ValueError, KeyError):
        return None
    return listed if listed and all(p.exists() for p in listed) else None


def resolve_jars() -> list[Path]:
    """Resolve the Delta jars through Ivy into the cache (network needed once) and record them."""
    found = cached_jars()
    if found is not None:
        return found
    from pyspark.sql import SparkSession

    ivy_home = cache_dir() / "ivy"
    ivy_home.mkdir(parents=True, exist_ok=True)
    spark = (
        SparkSession.builder.master("local[1]")
        .appName("cdc_apply-resolve-jars")
        .config("spark.jars.packages", delta_coordinate())
        .config("spark.jars.ivy", str(ivy_home))
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.stop()
    jars = sorted((ivy_home / "jars").glob("*.jar"))
    if not any("delta-spark" in jar.name for jar in jars):
        raise RuntimeError(f"Delta jars did not resolve into {ivy_home / 'jars'}")
    _manifest_path().write_text(json.dumps({"coordinate": delta_coordinate(), "jars": [str(j) for j in jars]}))
    return jars
