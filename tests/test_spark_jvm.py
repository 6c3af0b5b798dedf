"""The driver JVM's options (cdc_apply/spark/jvm.py): the class archive `cdc-apply setup` writes is
used by every session, and a config's own JVM options come after cdc_apply's."""

from __future__ import annotations

import pytest

from cdc_apply.spark.jvm import LOG4J_CONFIG, archive_path, driver_java_options
from cdc_apply.spark.session import spark_conf


def test_sessions_start_from_the_class_archive_setup_wrote(spark) -> None:  # type: ignore[no-untyped-def]
    archive = archive_path()
    assert archive.exists(), "./dev setup (cdc-apply setup) writes the archive before the tests run"
    options = spark.sparkContext.getConf().get("spark.driver.extraJavaOptions")
    assert f"-XX:SharedArchiveFile={archive}" in options
    jvm = spark.sparkContext._jvm
    assert "sharing" in jvm.java.lang.System.getProperty("java.vm.info")
    # The driver JVM itself was started with it (not only the conf).
    runtime = jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    assert f"-XX:SharedArchiveFile={archive}" in list(runtime.getInputArguments())


@pytest.mark.spark  # the class archive's name is keyed by the JVM that JAVA_HOME names
def test_configured_java_options_follow_cdc_apply_s_and_can_turn_the_archive_off() -> None:
    mine = spark_conf({"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"})["spark.driver.extraJavaOptions"]
    assert mine.startswith("-Dlog4j2.configurationFile=") and mine.endswith(" -XX:TieredStopAtLevel=1")
    assert "-XX:SharedArchiveFile=" in mine
    assert LOG4J_CONFIG.is_file(), "the option names cdc_apply's quiet log4j configuration, which must exist"
    # The JIT setting alone would leave 48 MB for compiled code, which a streaming driver fills.
    assert "-XX:ReservedCodeCacheSize=240m" in mine
    assert "ReservedCodeCacheSize=240m" not in driver_java_options("-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=64m")
    assert "ReservedCodeCacheSize" not in driver_java_options()
    off = driver_java_options("-Xshare:off")
    assert "SharedArchiveFile" not in off and off.endswith("-Xshare:off")
