"""Spark-native interfaces: the session with Delta and the ``pgoutput`` data source registered
(``session.py``, ``jars.py``), the data source (``datasource.py``) and its rows (``rows.py``), and the
``foreachBatch`` apply of its micro-batches (``foreach.py``).
"""

from cdc_apply.spark.datasource import PgOutputDataSource, register
from cdc_apply.spark.foreach import foreach_batch
from cdc_apply.spark.session import build_spark_session

__all__ = ["PgOutputDataSource", "build_spark_session", "foreach_batch", "register"]
