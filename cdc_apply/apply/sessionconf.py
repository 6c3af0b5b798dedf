"""Spark session confs set for exactly one Delta commit: commit info and transaction identifiers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"


@contextmanager
def session_conf(spark: SparkSession, conf: Mapping[str, str]) -> Iterator[None]:
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key in conf:
            spark.conf.unset(key)


def delta_commit_conf(spark: SparkSession, app_id: str | None, version: int, user_metadata: str):  # type: ignore[no-untyped-def]
    """The next Delta commit is skipped by Delta if ``app_id`` already committed ``version`` or later.

    ``app_id=None`` commits without a transaction identifier (initial snapshot chunks).
    """
    conf = {USER_METADATA: user_metadata}
    if app_id is not None:
        conf |= {TXN_APP_ID: app_id, TXN_VERSION: str(version)}
    return session_conf(spark, conf)
