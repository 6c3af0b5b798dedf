"""One Delta data commit's identity (commit info and transaction identifiers): the session confs set
for exactly that commit (a MERGE, UPDATE, DELETE), the writer options of an append, and
``DataCommit``, which carries them to the writers.

An append takes the writer options (Delta's ``txnAppId``/``txnVersion``/``userMetadata``): they
belong to that one write, where the confs are session state set and unset around it, six more round
trips to a Spark Connect server per append."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
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


def delta_write_options(app_id: str | None, version: int, user_metadata: str) -> dict[str, str]:
    """The Delta writer options of an append that Delta skips if ``app_id`` already committed
    ``version`` or later (``app_id=None``: no transaction identifier, as ``delta_commit_conf``)."""
    options = {"userMetadata": user_metadata}
    if app_id is not None:
        options |= {"txnAppId": app_id, "txnVersion": str(version)}
    return options


@dataclass(frozen=True)
class DataCommit:
    """Who makes a table's one data commit of a batch: the writer identity Delta records (None: an
    initial-snapshot chunk, which records none) and the commit info. ``unwritten_at``: a log version
    at which the caller read that ``app_id`` holds a version below ``version``, so an append need
    not have Delta check it (``apply/merge.py``, ``Target.append_known_version``)."""

    app_id: str | None
    version: int
    user_metadata: str
    unwritten_at: int | None = None

    def checked(self, spark: SparkSession) -> AbstractContextManager[None]:
        """The session confs under which Delta checks the version and records it."""
        return delta_commit_conf(spark, self.app_id, self.version, self.user_metadata)

    def write_options(self) -> dict[str, str]:
        """The writer options under which Delta checks the version of an append and records it."""
        return delta_write_options(self.app_id, self.version, self.user_metadata)
