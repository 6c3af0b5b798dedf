"""Spark side of cdc_apply: session, collapse, merge, schema evolution. The ``foreachBatch`` apply,
a driver of this package, is ``cdc_apply.spark.foreach_batch``."""

from cdc_apply.apply.session import build_spark_session

__all__ = ["build_spark_session"]
