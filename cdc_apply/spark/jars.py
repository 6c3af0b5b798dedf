"""Delta Lake and S3 jars: resolved from Maven Central once, then loaded from a local cache.

The first call resolves ``io.delta:delta-spark_<spark>_<scala>:<delta>``, Hadoop's S3A connector
(``org.apache.hadoop:hadoop-aws`` at the version of Spark's own Hadoop client) and the AWS SDK
modules S3A uses, with their dependencies, through Spark's own Ivy into the cache directory. Later
sessions pass the cached files as ``spark.jars``, so they start without Ivy and without network.

The SDK comes as its ``s3`` and ``s3-transfer-manager`` modules (41 jars, about 15 MB with Delta's)
instead of the ``bundle`` hadoop-aws names (641 MB); netty is Spark's own. The SDK version is the
one the Hadoop release was built with (``aws-java-sdk-v2.version`` in its hadoop-project pom); for
a Hadoop version not in ``AWS_SDK_FOR_HADOOP``, the bundle is resolved as hadoop-aws names it.
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


# hadoop-project's aws-java-sdk-v2.version, read from each release's pom
AWS_SDK_FOR_HADOOP = {"3.4.2": "2.29.52", "3.5.0": "2.35.4"}
AWS_SDK_MODULES = ("s3", "s3-transfer-manager")
# what the SDK's netty-nio-client depends on, which Spark ships (a newer netty of the same API)
SPARK_NETTY = ("netty-common", "netty-buffer", "netty-transport", "netty-codec", "netty-codec-http",
               "netty-codec-http2", "netty-handler", "netty-resolver", "netty-transport-classes-epoll",
               "netty-transport-native-unix-common")


def spark_hadoop_version() -> str:
    """The Hadoop client version pyspark ships (``jars/hadoop-client-api-<version>.jar``)."""
    import pyspark

    # pip's pyspark keeps its jars beside it; under spark-submit pyspark is imported from a zip and
    # the jars are in SPARK_HOME
    homes = [Path(pyspark.__file__).parent, *([Path(os.environ["SPARK_HOME"])] if "SPARK_HOME" in os.environ else [])]
    found = sorted(jar for home in homes for jar in home.joinpath("jars").glob("hadoop-client-api-*.jar"))
    if not found:
        raise RuntimeError("pyspark ships no hadoop-client-api jar: cannot tell which hadoop-aws matches it")
    return found[-1].name[len("hadoop-client-api-"):-len(".jar")]


def coordinates() -> tuple[list[str], list[str]]:
    """(Maven coordinates to resolve, coordinates to leave out)."""
    hadoop = spark_hadoop_version()
    packages = [delta_coordinate(), f"org.apache.hadoop:hadoop-aws:{hadoop}"]
    sdk = AWS_SDK_FOR_HADOOP.get(hadoop)
    if sdk is None:
        return packages, []
    packages += [f"software.amazon.awssdk:{module}:{sdk}" for module in AWS_SDK_MODULES]
    return packages, ["software.amazon.awssdk:bundle", *(f"io.netty:{module}" for module in SPARK_NETTY)]


def cache_dir() -> Path:
    configured = os.environ.get("CDC_APPLY_JAR_CACHE")
    base = Path(configured) if configured else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    if not configured:
        base = base / "cdc_apply" / "jars"
    return base / delta_coordinate().replace(":", "_")


def _manifest_path() -> Path:
    return cache_dir() / "jars.json"


def cached_jars() -> list[Path] | None:
    """The cached jar files, or None when they have not been resolved (or were removed, or resolved
    for other coordinates: an older release's cache lacks the S3 jars)."""
    try:
        manifest = json.loads(_manifest_path().read_text())
        listed = [Path(p) for p in manifest["jars"]]
        if manifest.get("packages") != coordinates()[0]:
            return None
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    return listed if listed and all(p.exists() for p in listed) else None


def resolve_jars() -> list[Path]:
    """Resolve the Delta jars through Ivy into the cache (network needed once) and record them."""
    found = cached_jars()
    if found is not None:
        return found
    from pyspark.sql import SparkSession

    packages, excludes = coordinates()
    ivy_home = cache_dir() / "ivy"
    ivy_home.mkdir(parents=True, exist_ok=True)
    builder = (
        SparkSession.builder.master("local[1]")
        .appName("cdc_apply-resolve-jars")
        .config("spark.jars.packages", ",".join(packages))
        .config("spark.jars.ivy", str(ivy_home))
        .config("spark.ui.enabled", "false")
    )
    if excludes:
        builder = builder.config("spark.jars.excludes", ",".join(excludes))
    spark = builder.getOrCreate()
    spark.stop()
    resolved = {f"{p.split(':')[0]}_{p.split(':')[1]}-{p.split(':')[2]}.jar" for p in packages}
    jars = sorted(jar for jar in (ivy_home / "jars").glob("*.jar")
                  if not any(jar.name.startswith(f"io.netty_{module}-") for module in SPARK_NETTY))
    missing = resolved - {jar.name for jar in jars}
    if missing:
        raise RuntimeError(f"jars did not resolve into {ivy_home / 'jars'}: {', '.join(sorted(missing))}")
    _manifest_path().write_text(json.dumps({"coordinate": delta_coordinate(), "packages": packages,
                                            "jars": [str(j) for j in jars]}))
    return jars
