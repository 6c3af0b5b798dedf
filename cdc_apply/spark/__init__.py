"""Spark-native interfaces: the session with Delta and the ``pgoutput`` data source registered
(``session.py``, ``jars.py``), the data source (``datasource.py``) and its rows (``rows.py``), the
``foreachBatch`` apply of its micro-batches (``foreach.py``), and the initial copy's tasks (``pgcopy.py``).
"""

from typing import Any

from cdc_apply.spark.datasource import PgOutputDataSource, register
from cdc_apply.spark.session import build_spark_session

__all__ = ["PgOutputDataSource", "build_spark_session", "foreach_batch", "register"]


def __getattr__(name: str) -> Any:
    # foreach_batch drives the sink, which copies tables through pgcopy in this package: loaded when
    # first asked for, so that importing the sink does not import it back half-made.
    if name == "foreach_batch":
        from cdc_apply.spark.foreach import foreach_batch

        return foreach_batch
    raise AttributeError(name)
