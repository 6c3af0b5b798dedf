"""Spark-native interfaces: the ``pgoutput`` data source (``datasource.py``) and its rows (``rows.py``).

The ``foreachBatch`` apply is ``cdc_apply.apply.foreach_batch``.
"""

from cdc_apply.spark.datasource import PgOutputDataSource, register

__all__ = ["PgOutputDataSource", "register"]
