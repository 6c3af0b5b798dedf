"""``python -m cdc_apply.spark.warm_up JAVA_OPTIONS``: the small Delta workload whose JVM writes the
class archive at exit (``cdc_apply.spark.jvm.build_class_archive`` runs it)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from cdc_apply.spark.session import build_spark_session


def warm_up(java_options: str) -> None:
    spark = build_spark_session({"spark.driver.extraJavaOptions": java_options})
    from delta.tables import DeltaTable

    with tempfile.TemporaryDirectory(prefix="cdc_apply-warm-up-") as directory:
        path = str(Path(directory) / "t")
        spark.range(100).selectExpr("id", "cast(id AS string) AS s").write.format("delta").save(path)
        source = spark.range(50, 150).selectExpr("id", "'x' AS s")
        (DeltaTable.forPath(spark, path).alias("t").merge(source.alias("s"), "t.id = s.id")
         .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())
        spark.read.format("delta").load(path).count()
    spark.stop()


if __name__ == "__main__":
    warm_up(sys.argv[1])
