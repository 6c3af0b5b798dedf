"""Spark-native interfaces: the ``pgoutput`` data source (``datasource.py``) and its rows (``rows.py``).

and the ``foreachBatch`` apply of its micro-batches (``foreach.py``).
"""

from cdc_apply.spark.datasource import PgOutputDataSource, register
from cdc_apply.spark.foreach import foreach_batch

__all__ = ["PgOutputDataSource", "foreach_batch", "register"]
