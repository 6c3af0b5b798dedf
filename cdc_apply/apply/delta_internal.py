"""Delta's internal Scala classes, reached over py4j: the one module that uses them (docs/spark.md).

Two commits have no public API as fast:
- ``KnownVersionAppend``: an append that records a writer's next ``txnVersion`` without Delta's own
  check of it, which rebuilds the table state (three Spark jobs, most of a small append's time);
  the caller read from the log that the version is not there yet (invariant 13 in
  docs/architecture.md).
- ``FileAppend``: a commit of Parquet files written outside Delta's writer (the copy's tasks, the
  change log's appends).

Each is used only on a classic session (a py4j gateway into the driver's JVM) and only when
``apply.delta_internals`` allows it (``ApplyOptions.internals``); everywhere else, and on a Spark
Connect session, the caller takes the public path: the ``txnAppId``/``txnVersion`` writer options
or session confs, and Delta's own writer. ``bench apply --delta-internals off`` measures what this
module buys.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cdc_apply.apply.files import WrittenFile

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def available(spark: SparkSession) -> bool:
    """Whether ``spark`` is a classic session, whose driver JVM py4j reaches."""
    from cdc_apply.apply.session_kind import is_connect

    return not is_connect(spark)


def delta_log(spark: SparkSession, location: str) -> Any:
    """Delta's ``DeltaLog`` of the table at ``location`` (a catalog table's: its location), with
    ``spark`` set as the JVM thread's active session: a py4j thread of ours (a parallel table, a
    foreachBatch callback) may have none, and Delta's snapshot would then fail with
    DELTA_SPARK_SESSION_NOT_SET."""
    jvm = spark._jvm  # type: ignore[attr-defined]
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)  # type: ignore[attr-defined]
    return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, location)  # type: ignore[attr-defined]


def open_known_version_append(spark: SparkSession, location: str, app_id: str,
                              read_at: int) -> KnownVersionAppend | None:
    """A transaction for an append of ``app_id``'s next version, opened at log version ``read_at``;
    None when the log has moved past it."""
    transaction = delta_log(spark, location).startTransaction()
    if int(transaction.snapshot().version()) != read_at:
        return None
    transaction.readTxn().addOne(app_id)
    return KnownVersionAppend(spark, transaction, app_id)


def open_file_append(spark: SparkSession, location: str, partition_by: Sequence[str], app_id: str | None,
                     read_at: int | None) -> FileAppend | None:
    """See ``Target.open_file_append``; the table's own refusals are decided here, from the
    transaction's metadata."""
    transaction = delta_log(spark, location).startTransaction()
    if read_at is not None and int(transaction.snapshot().version()) != read_at:
        return None
    metadata = transaction.metadata()
    fields = json.loads(metadata.schema().json())["fields"]
    configuration = _scala_map(metadata.configuration())
    mapped = configuration.get("delta.columnMapping.mode", "none") != "none"
    nested = any("struct" in json.dumps(f["type"]) for f in fields)
    partitioned = [str(column) for column in _scala_list(metadata.partitionColumns())]
    if partitioned != list(partition_by) or (mapped and nested):
        return None
    # What Delta's writer enforces or fills in for a table cdc_apply adopted: CHECK constraints,
    # invariants, generated and identity columns, UniForm's Iceberg metadata.
    if any(set(f["metadata"]) - _PLAIN_FIELD_METADATA for f in fields) or any(
            key.startswith(_WRITER_ENFORCED) for key in configuration):
        return None
    if app_id is not None:
        transaction.readTxn().addOne(app_id)
    return FileAppend(spark, transaction, fields, app_id)


def _scala_map(entries: Any, value: Callable[[Any], Any] = str) -> dict[str, Any]:
    """A Scala ``Map`` from py4j as a dict of ``str`` keys and ``value(v)`` values."""
    found: dict[str, Any] = {}
    iterator = entries.iterator()
    while iterator.hasNext():
        entry = iterator.next()
        found[str(entry._1())] = value(entry._2())
    return found


def _scala_list(items: Any) -> list[Any]:
    """A Scala ``Seq`` from py4j as a list."""
    iterator = items.iterator()
    found = []
    while iterator.hasNext():
        found.append(iterator.next())
    return found



_WRITE_METRICS = ("numFiles", "numOutputRows", "numOutputBytes")  # a WRITE commit's operation metrics


_PLAIN_FIELD_METADATA = {"delta.columnMapping.id", "delta.columnMapping.physicalName", "comment"}
_WRITER_ENFORCED = ("delta.constraints.", "delta.universalFormat.", "delta.enableIcebergCompat")


class KnownVersionAppend:
    """One append commit that records ``app_id`` -> a version (a SetTransaction) without asking Delta
    whether ``app_id`` holds that version already: the caller read, at the log version the
    transaction was opened at, that it does not (invariant 13 in docs/architecture.md). Delta's own
    check (``txnAppId``/``txnVersion``) rebuilds the table state for it, three Spark jobs and most
    of a small append's time.

    Frames are written (``write``) one after another, each into files no reader sees yet, and
    ``commit`` makes them all visible in one Delta commit: a large transaction's rows are written a
    piece at a time, and stay one commit. The commit fails if another commit came in between that
    conflicts, as Delta's own would (the app id is registered as read). Files written but never
    committed are not part of the table (VACUUM removes them)."""

    def __init__(self, spark: SparkSession, transaction: Any, app_id: str) -> None:
        from pyspark.sql.types import StructType

        self.spark = spark
        self.app_id = app_id
        self._transaction = transaction
        self._table_types = {field.name: field.dataType for field in
                             StructType.fromJson(json.loads(transaction.metadata().schema().json())).fields}
        self._files: Any = None  # the AddFile actions written so far (a Scala Seq)

    def write(self, frame: DataFrame) -> bool:
        """Write ``frame``'s rows into new files of the table; False (nothing written) when it has a
        column the table has not, or one of another type."""
        if any(self._table_types.get(field.name) != field.dataType for field in frame.schema.fields):
            return False
        before = {name: self._metric(name) for name in _WRITE_METRICS}
        files = self._transaction.writeFiles(frame._jdf)
        self._files = files if self._files is None else self._files.appendedAll(files)
        # Each write registers new metrics for the commit info, which replace the last write's:
        # carry the totals so far into them, so the commit says what all the writes wrote.
        for name, earlier in before.items():
            metric = self._metric(name)
            if earlier is not None and metric is not None and metric.id() != earlier.id():
                metric.add(earlier.value())
        return True

    def _metric(self, name: str) -> Any:
        metric = self._transaction.getMetric(name)
        return metric.get() if metric.isDefined() else None

    def commit(self, txn_version: int, user_metadata: str) -> None:
        jvm = self.spark._jvm  # type: ignore[attr-defined]
        actions = _scala_seq(jvm, []) if self._files is None else self._files
        self._transaction.commit(actions.appended(_set_transaction(jvm, self.app_id, txn_version)),
                                 _append_operation(jvm, user_metadata))


class FileAppend:
    """One append commit of files written outside Delta's writer, opened before they are written:
    they are written with this transaction's physical column names, and the commit fails if the
    table's metadata changed since (Delta's conflict check). The files carry the statistics their
    writer gives (``WrittenFile.stats``). With an ``app_id``, the commit also records its version,
    unchecked, as ``KnownVersionAppend`` does (the caller read that the table does not hold it)."""

    def __init__(self, spark: SparkSession, transaction: Any, fields: list[dict[str, Any]],
                 app_id: str | None = None) -> None:
        """``fields``: the transaction's schema fields, as Delta's JSON."""
        self.spark = spark
        self.app_id = app_id
        self._transaction = transaction
        self.fields = fields
        # With column mapping, a column's Parquet name is its physical name (and its field id).
        self.physical_columns: dict[str, tuple[str, int | None]] = {
            field["name"]: (field["metadata"].get("delta.columnMapping.physicalName", field["name"]),
                            field["metadata"].get("delta.columnMapping.id")) for field in fields}

    def commit(self, files: Sequence[WrittenFile], user_metadata: str, txn_version: int | None = None) -> None:
        """``files`` in one commit; with the ``app_id``, ``txn_version`` recorded as its version."""
        jvm = self.spark._jvm  # type: ignore[attr-defined]
        now = int(time.time() * 1000)
        action = jvm.org.apache.spark.sql.delta.actions.Action
        actions = [action.fromJson(json.dumps({"add": {
            "path": file.path, "partitionValues": dict(file.partition_values), "size": file.size,
            "modificationTime": now, "dataChange": True, "stats": file.stats}})) for file in files]
        if self.app_id is not None:
            assert txn_version is not None
            actions.append(_set_transaction(jvm, self.app_id, txn_version))
        self._transaction.commit(_scala_seq(jvm, actions), _append_operation(jvm, user_metadata))


def _set_transaction(jvm: Any, app_id: str, txn_version: int) -> Any:
    """The action that records ``app_id``'s ``txn_version`` (Delta's ``txnAppId``/``txnVersion``)."""
    now = jvm.java.lang.Long.valueOf(str(int(time.time() * 1000)))
    return jvm.org.apache.spark.sql.delta.actions.SetTransaction(app_id, txn_version, jvm.scala.Some(now))


def _scala_seq(jvm: Any, items: Sequence[Any]) -> Any:
    listed = jvm.java.util.ArrayList()
    for item in items:
        listed.add(item)
    return jvm.scala.jdk.javaapi.CollectionConverters.asScala(listed).toSeq()


def _append_operation(jvm: Any, user_metadata: str) -> Any:
    """Delta's WRITE (append) operation, with ``user_metadata`` as the commit's userMetadata."""
    none = jvm.scala.Option.empty()
    return getattr(jvm.org.apache.spark.sql.delta, "DeltaOperations$Write")(
        jvm.org.apache.spark.sql.SaveMode.Append, none, none, jvm.scala.Some(user_metadata), none, none, none, none,
        none)
