"""Delta target tables: where each source relation lands, creation, and the state kept in the table.

Invariants:
- A target is found by the source relation OID (``TargetRegistry``), so a renamed source table
  keeps writing to the table it started with.
- The table carries its own source state in the ``cdc_apply.source`` table property: the relation
  OID, the key columns and every source column with the target column it feeds. That state is
  updated only after the schema change it describes has committed, and every schema action checks
  the Delta schema first, so a crash between the two repeats nothing twice.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdc_apply.apply.files import WrittenFile
from cdc_apply.lake.location import FileRoot, Location, Storage
from cdc_apply.lake.state import TargetRegistry  # noqa: F401 - its home before cdc_apply.lake
from cdc_apply.apply.options import (
    COMMIT_LSN, COMMIT_TS, CURRENT, DELETED, METADATA_PREFIX, VALID_FROM, VALID_TO, TableOptions,
)
from cdc_apply.apply.schema import SourceColumn

if TYPE_CHECKING:
    from delta.tables import DeltaTable
    from pyspark.sql import DataFrame, SparkSession

SOURCE_PROPERTY = "cdc_apply.source"
_NEEDS_COLUMN_MAPPING = re.compile(r"[ ,;{}()\n\t=]")


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


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


def needs_column_mapping(column: str) -> bool:
    return bool(_NEEDS_COLUMN_MAPPING.search(column))


def metadata_columns(options: TableOptions) -> list[tuple[str, str]]:
    columns = [(COMMIT_LSN, "bigint"), (COMMIT_TS, "timestamp")]
    if options.scd_type == 2:  # history ends versions on delete: no delete mode applies
        columns += [(VALID_FROM, "timestamp"), (VALID_TO, "timestamp"), (CURRENT, "boolean")]
    elif options.delete_mode == "soft":
        columns.append((DELETED, "boolean"))
    return columns


@dataclass
class SourceState:
    relation_oid: int
    schema: str
    table: str
    keys: tuple[str, ...]  # target column names
    columns: list[SourceColumn]
    applied_at: tuple[int, int]  # (commit_lsn, seq) of the first change decoded under this definition
    merge_until: int = 0  # a resumed copy's newest consistent point: no append of new rows up to it
    # The keys are the whole row (REPLICA IDENTITY FULL when the target was keyed), not a unique key.
    whole_row: bool = False
    # Source columns schema_policy evolve switched to PostgreSQL's text: a value did not fit their type.
    text_columns: tuple[str, ...] = ()

    def column_map(self) -> dict[str, str | None]:
        return {col.name: col.target for col in self.columns}

    def to_json(self) -> str:
        return json.dumps({"relation_oid": self.relation_oid, "schema": self.schema, "table": self.table,
                           "keys": list(self.keys), "applied_at": list(self.applied_at),
                           "merge_until": self.merge_until, "whole_row": self.whole_row,
                           "text_columns": list(self.text_columns),
                           "columns": [[c.name, c.spark_type, c.target] for c in self.columns]})

    @classmethod
    def from_json(cls, text: str) -> SourceState:
        data = json.loads(text)
        columns = [SourceColumn(*col) for col in data["columns"]]
        keys = tuple(data["keys"])
        # Written before the flag existed: a key of every column the target has is a whole-row key.
        whole_row = data.get("whole_row", bool(keys) and set(keys) == {c.target for c in columns if c.target})
        return cls(data["relation_oid"], data["schema"], data["table"], keys, columns, tuple(data["applied_at"]),
                   data.get("merge_until", 0), whole_row, tuple(data.get("text_columns", ())))


class Target:
    """One Delta table: by path (``<warehouse>/<schema>/<table>``) or by metastore name."""

    def __init__(self, spark: SparkSession, location: str, by_name: bool) -> None:
        self.spark = spark
        self.location = location
        self.by_name = by_name

    @property
    def sql(self) -> str:
        return self.location if self.by_name else f"delta.{quote(self.location)}"

    def exists(self) -> bool:
        from delta.tables import DeltaTable

        if self.by_name:
            return bool(self.spark.catalog.tableExists(self.location))
        return DeltaTable.isDeltaTable(self.spark, self.location)

    def delta(self) -> DeltaTable:
        from delta.tables import DeltaTable

        if self.by_name:
            return DeltaTable.forName(self.spark, self.location)
        return DeltaTable.forPath(self.spark, self.location)

    def read(self) -> DataFrame:
        if self.by_name:
            return self.spark.read.table(self.location)
        return self.spark.read.format("delta").load(self.location)

    def column_types(self) -> dict[str, str]:
        return {f.name: f.dataType.simpleString() for f in self.read().schema.fields}

    def data_types(self) -> dict[str, str]:
        """The source-fed columns (everything but the ``_cdc_`` metadata columns)."""
        return {name: kind for name, kind in self.column_types().items() if not name.startswith(METADATA_PREFIX)}

    def properties(self) -> dict[str, str]:
        """The table's properties, from the newest snapshot's metadata (no ``DESCRIBE DETAIL``, which
        rebuilds the file list for its size figures)."""
        return _scala_map(self._snapshot().metadata().configuration())

    def source_state(self) -> SourceState | None:
        """None for a Delta table cdc_apply did not create (it is then adopted as it is)."""
        text = self.properties().get(SOURCE_PROPERTY)
        return SourceState.from_json(text) if text else None

    def committed_version(self, app_id: str) -> int | None:
        """The last ``txnVersion`` committed under ``app_id`` (Delta's SetTransaction), or None."""
        return self.committed_versions().get(app_id)

    def committed_versions(self) -> dict[str, int]:
        """Every writer identity's last ``txnVersion`` (Delta's SetTransactions): app id -> version.

        Read from the newest version's checksum file when it lists them, as later Delta releases do
        (``setTransactionsIfKnown``): rebuilding the table state instead costs Spark jobs, seconds
        for each table a restarted pipeline checks. Without a checksum, or when the table expires
        SetTransactions (``delta.setTransactionRetentionDuration``, which the checksum does not
        apply), the state is rebuilt."""
        return self._versions_in(self._snapshot())

    def _versions_in(self, snapshot: Any) -> dict[str, int]:
        checksum = snapshot.checksumOpt()
        if checksum.isDefined() and checksum.get().setTransactions().isDefined() \
                and snapshot.minSetTransactionRetentionTimestamp().isEmpty():
            entries = checksum.get().setTransactions().get().iterator()
            versions: dict[str, int] = {}
            while entries.hasNext():
                entry = entries.next()
                versions[str(entry.appId())] = int(entry.version())
            return versions
        return _scala_map(snapshot.transactions(), int)

    def log_version(self) -> int:
        """The newest version in the Delta log (-1: no table). Lists the log, reads no table state."""
        return int(self._snapshot().version())

    def _snapshot(self) -> Any:
        """The Delta log's newest snapshot (lists the log; the table state is built only on use)."""
        empty = self.spark._jvm.scala.Option.empty()  # type: ignore[attr-defined]
        return self._delta_log().update(False, empty, empty)

    def commit_is(self, log_version: int, app_id: str | None, txn_version: int, user_metadata: str) -> bool:
        """Whether the commit ``log_version`` is the one a writer made with these confs: its
        SetTransaction says ``app_id`` -> ``txn_version`` (or, without an app id, its commit info
        carries ``user_metadata``). Reads that one commit file."""
        empty = self.spark._jvm.scala.Option.empty()  # type: ignore[attr-defined]
        changes = self._delta_log().getChanges(log_version, log_version, empty, False)
        if not changes.hasNext():
            return False
        commit = changes.next()
        if int(commit._1()) != log_version:
            return False
        actions = commit._2().iterator()
        while actions.hasNext():
            action = actions.next()
            kind = action.getClass().getSimpleName()
            if app_id is not None and kind == "SetTransaction" and str(action.appId()) == app_id:
                return int(action.version()) == txn_version
            if app_id is None and kind == "CommitInfo":
                said = action.userMetadata()
                return bool(said.isDefined()) and str(said.get()) == user_metadata
        return False

    def _delta_log(self) -> Any:
        jvm = self.spark._jvm  # type: ignore[attr-defined]
        # Delta rebuilds the snapshot with the JVM thread's active session. A py4j thread of ours
        # (a parallel table, a foreachBatch callback) may have none: set it, or the read fails with
        # DELTA_SPARK_SESSION_NOT_SET.
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(self.spark._jsparkSession)  # type: ignore[attr-defined]
        delta_log = jvm.org.apache.spark.sql.delta.DeltaLog
        if self.by_name:
            table = jvm.org.apache.spark.sql.catalyst.TableIdentifier.apply(self.location)
            return delta_log.forTable(self.spark._jsparkSession, table)  # type: ignore[attr-defined]
        return delta_log.forTable(self.spark._jsparkSession, self.location)  # type: ignore[attr-defined]

    def clear(self) -> None:
        self.spark.sql(f"DELETE FROM {self.sql}")

    def record_version(self, app_id: str, version: int, user_metadata: str) -> None:
        """An empty commit whose only news is ``app_id`` reaching ``version`` (Delta's SetTransaction),
        skipped when ``app_id`` holds ``version`` or later already, as Delta's own check would.

        Committed as a ``KnownVersionAppend`` of no files, opened at the log version whose
        SetTransactions were read: an empty append under the commit confs is a Spark job, and
        Delta's check may rebuild the table state. Seconds of each table's initial copy."""
        from cdc_apply.apply.sessionconf import delta_commit_conf

        snapshot = self._snapshot()
        held = self._versions_in(snapshot).get(app_id)
        if held is not None and held >= version:
            return
        append = self.open_known_version_append(app_id, int(snapshot.version()))
        if append is not None:
            append.commit(version, user_metadata)
            return
        with delta_commit_conf(self.spark, app_id, version, user_metadata):  # the log moved: Delta checks
            self.write(self.read().limit(0), "append")

    def append_known_version(self, frame: DataFrame, app_id: str, txn_version: int, user_metadata: str,
                             read_at: int) -> bool:
        """Append ``frame`` in one commit that records ``app_id`` -> ``txn_version`` (a SetTransaction),
        without asking Delta whether ``app_id`` holds that version already (``KnownVersionAppend``).
        Writes nothing and returns False when the log has moved past ``read_at`` or ``frame`` does
        not fit the table: the caller then writes with the commit confs, and Delta checks."""
        append = self.open_known_version_append(app_id, read_at)
        if append is None or not append.write(frame):
            return False
        append.commit(txn_version, user_metadata)
        return True

    def open_known_version_append(self, app_id: str, read_at: int) -> KnownVersionAppend | None:
        """A Delta transaction for an append of ``app_id``'s next version, opened at log version
        ``read_at``; None when the log has moved past it."""
        transaction = self._delta_log().startTransaction()
        if int(transaction.snapshot().version()) != read_at:
            return None
        transaction.readTxn().addOne(app_id)
        return KnownVersionAppend(self.spark, transaction, app_id)

    def open_file_append(self, partition_by: Sequence[str] = (), app_id: str | None = None,
                         read_at: int | None = None, storage: Storage | None = None) -> FileAppend | None:
        """An append of files written outside Delta's writer (``FileAppend``); None when this table
        takes only Delta's writer: a table by name, a location on an object store without the
        ``storage`` that reaches it (the writers do not share the JVM's Hadoop credentials), a table
        partitioned otherwise than ``partition_by`` (the columns the writer puts in the files'
        directories), a struct column under column mapping (its fields have physical names of their
        own), or what Delta's writer enforces or fills in. With ``app_id``, the commit records
        ``app_id``'s next version as ``KnownVersionAppend`` does, and None also when the log has
        moved past ``read_at``."""
        if self.by_name or (storage is None and not Location.parse(self.location).local):
            return None
        transaction = self._delta_log().startTransaction()
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
        return FileAppend(self.spark, transaction, fields, app_id)

    def file_root(self, storage: Storage | None = None) -> FileRoot:
        """The table's directory, and how to reach it, for the files of a ``FileAppend``."""
        return FileRoot(Location.parse(self.location), storage or Storage())

    def write(self, frame: DataFrame, mode: str, partition_by: Sequence[str] = (), **options: str) -> None:
        """``frame`` written to this table (``append`` or ``overwrite``), by path or by name."""
        writer = frame.write.format("delta").mode(mode).options(**options)
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        if self.by_name:
            writer.saveAsTable(self.location)
        else:
            writer.save(self.location)

    def create(self, state: SourceState, data_types: Mapping[str, str], options: TableOptions,
               table_properties: Mapping[str, str], replace: bool = False) -> None:
        """``replace``: an existing table is emptied and gets today's schema and properties; its
        history and transaction versions stay. Two commits (properties, then the schema and no
        rows): the caller must be able to repeat both after a crash (a resync's mark does that)."""
        columns = [(c.target, data_types[c.name]) for c in state.columns if c.target is not None]
        columns += metadata_columns(options)
        # No table feature a reader must support is switched on here: type widening and column mapping
        # come at the first schema change that needs them (evolve.py), so a new target stays readable
        # by delta-rs and other readers (docs/apply.md, "Readers and table features").
        properties = {**table_properties, **options.properties}
        if any(needs_column_mapping(name) for name, _ in columns):
            properties.setdefault("delta.columnMapping.mode", "name")
        properties[SOURCE_PROPERTY] = state.to_json()
        ddl = ", ".join(f"{quote(name)} {spark_type}" for name, spark_type in columns)
        props = ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in properties.items())
        if replace:
            # CREATE OR REPLACE on a path refuses properties that differ from the existing ones.
            self.spark.sql(f"ALTER TABLE {self.sql} SET TBLPROPERTIES ({props})")
            self.write(self.spark.createDataFrame([], ddl), "overwrite", options.partition_by, overwriteSchema="true")
            return
        partitioned = f" PARTITIONED BY ({', '.join(map(quote, options.partition_by))})" if options.partition_by else ""
        self.spark.sql(f"CREATE TABLE IF NOT EXISTS {self.sql} ({ddl}) USING delta{partitioned} "
                       f"TBLPROPERTIES ({props})")


def sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


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
