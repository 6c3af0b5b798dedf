"""Change rows -> Delta: target plan, schema evolution, collapse and the writers (merge, append,
history). The Spark session (``cdc_apply.spark.build_spark_session``) and the ``foreachBatch``
apply (``cdc_apply.spark.foreach_batch``) are drivers of this package and live in ``cdc_apply.spark``."""
