"""The driver JVM's options: quiet logs, and a class-data sharing (CDS) archive for a faster start.

A JVM started with ``-XX:SharedArchiveFile`` maps the classes an earlier run loaded (Spark,
Catalyst, Delta) instead of loading and verifying them again. ``cdc-apply setup`` makes the
archive once, by running a small Delta workload in a JVM that writes it at exit; every later
driver uses it. It only changes how fast the JVM starts, never what it runs: a JVM that finds the
archive unusable (another Java, another class path) ignores it. The archive's name carries the
Java runtime, pyspark's install and version, and the Delta jars, so an upgrade or a second
environment makes its own.
Measured on the 2-core machine, a session start plus the first Delta write and MERGE: about 31 s
without the archive, 28 s with it, and 20 s with it and ``-XX:TieredStopAtLevel=1`` (a JIT
setting for short jobs, e.g. ``run --once`` from a scheduler; see docs/config.md, ``spark``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
CDS_FLAGS = ("-XX:SharedArchiveFile", "-XX:ArchiveClassesAtExit", "-Xshare")
CODE_CACHE = "240m"  # the JVM's own default with tiered compilation


def _java_home() -> str:
    home = os.environ.get("JAVA_HOME")
    if home:
        return os.path.realpath(home)
    java = shutil.which("java")
    return os.path.realpath(java) if java else ""


def archive_path() -> Path:
    import pyspark

    from cdc_apply.spark.jars import cache_dir, cached_jars

    jars = sorted(str(p) for p in cached_jars() or [])
    # The JVM's class path is pyspark's own jars directory: another install (a second venv) needs
    # its own archive, which the JVM would otherwise silently refuse.
    installed = os.path.dirname(os.path.realpath(pyspark.__file__))
    key = hashlib.sha256("\n".join([_java_home(), installed, pyspark.__version__, *jars]).encode()).hexdigest()[:16]
    return cache_dir() / "jvm" / f"classes-{key}.jsa"


def java_option(option: str) -> str:
    """One JVM option as one word of an options string: Spark splits ``extraJavaOptions`` and
    ``--driver-java-options`` at spaces outside double quotes, so a path with a space in it (a clone
    under ``/root/my work``) is quoted."""
    if not any(char.isspace() for char in option):
        return option
    escaped = option.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def driver_java_options(configured: str | None = None) -> str:
    """cdc_apply's driver options first, the config's ``spark.driver.extraJavaOptions`` after them
    (for a flag given twice the JVM takes the last). The archive is left out when the config
    manages CDS itself."""
    given = configured or ""
    options = [java_option(f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}")]
    archive = archive_path()
    if archive.exists() and not any(flag in given for flag in CDS_FLAGS):
        options += [java_option(f"-XX:SharedArchiveFile={archive}"), "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    if "-XX:TieredStopAtLevel" in given and "-XX:ReservedCodeCacheSize" not in given:
        # Without tiered compilation the JVM reserves 48 MB for compiled code, not 240 MB: a Spark
        # driver fills that within a minute of streaming, the compiler stops, and the JVM then
        # dies with "Out of space in CodeCache for method handle intrinsic".
        options.append(f"-XX:ReservedCodeCacheSize={CODE_CACHE}")
    return " ".join(options + ([given] if given else []))


def build_class_archive() -> Path:
    """Write the archive (a few tens of seconds, once): a child JVM runs a small Delta workload and
    dumps the classes it loaded at exit, to a temporary name renamed into place when complete."""
    target = archive_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    options = f"{java_option(f'-XX:ArchiveClassesAtExit={partial}')} -Xlog:cds=off -Xlog:cds+dynamic=off"
    result = subprocess.run([sys.executable, "-m", "cdc_apply.spark.warm_up", options], capture_output=True, text=True)
    if result.returncode != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"could not build the JVM class archive: {result.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target
