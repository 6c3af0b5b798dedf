"""Spark-native interfaces: the session with Delta and the ``pgoutput`` data source registered
(``session.py``, ``jars.py``, ``jvm.py``), the data source (``datasource.py``) and its rows
(``rows.py``, ``typed.py``), and the ``foreachBatch`` apply of its micro-batches (``foreach.py``).
The copy's tasks are in ``cdc_apply/snapshot``, the change log's files in ``cdc_apply/changelog``.
"""

from typing import Any

from cdc_apply.spark.datasource import PgOutputDataSource, register
from cdc_apply.spark.session import build_spark_session

__all__ = ["PgOutputDataSource", "build_spark_session", "foreach_batch", "register"]


def __getattr__(name: str) -> Any:
    # foreach_batch drives the sink and apply: loaded when first asked for, so that a session or the
    # data source (a Spark worker's import) does not load them.
    if name == "foreach_batch":
        from cdc_apply.spark.foreach import foreach_batch

        return foreach_batch
    raise AttributeError(name)
