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
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_apply.apply import delta_internal, fence
from cdc_apply.apply.staging import NO_STAGING, Staging
from cdc_apply.apply.delta_log import LogState, commit_actions, log_state
from cdc_apply.lake.location import FileRoot, Location, Storage
from cdc_apply.lake.state import TargetRegistry  # noqa: F401 - its home before cdc_apply.lake
from cdc_apply.apply.options import (
    COMMIT_LSN, COMMIT_TS, CURRENT, DELETED, METADATA_PREFIX, VALID_FROM, VALID_TO, ApplyOptions, TableOptions,
)
from cdc_apply.apply.schema import SourceColumn
from cdc_apply.errors import CdcApplyError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SOURCE_PROPERTY = "cdc_apply.source"
BY_NAME_KEYS = "target.name_template, a table's name or changelog.name"
_named_locations: dict[str, str] = {}  # a table by name -> its location, read once from the catalog
_NEEDS_COLUMN_MAPPING = re.compile(r"[ ,;{}()\n\t=]")


class TargetCatalogError(CdcApplyError):
    """A target by catalog name that the session's catalog cannot keep or hold."""


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


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
    """One Delta table: by path (``<warehouse>/<schema>/<table>``) or by metastore name.

    Its state (log version, properties, writers' versions) is read from the Delta log's files
    (``apply/delta_log.py``); its writes are Spark SQL and the DataFrame writer, which a classic
    session and a Spark Connect session run alike. Two commits take Delta's internal classes on a
    classic session when ``internals`` allows (``apply/delta_internal.py``), with the public path
    as their fallback."""

    def __init__(self, spark: SparkSession, location: str, by_name: bool, storage: Storage | None = None,
                 internals: bool = True, staging: Staging = NO_STAGING) -> None:
        self.spark = spark
        self.staging = staging  # how its large frames reach Spark (apply/staging.py)
        self.location = location
        self.by_name = by_name
        self.storage = storage or Storage()
        self.internals = internals and delta_internal.available(spark)

    @property
    def sql(self) -> str:
        return self.location if self.by_name else f"delta.{quote(self.location)}"

    def exists(self) -> bool:
        if self.by_name:
            return bool(self.spark.catalog.tableExists(self.location))
        return self.log_version() >= 0

    def read(self) -> DataFrame:
        if self.by_name:
            return self.spark.read.table(self.location)
        return self.spark.read.format("delta").load(self.location)

    def column_types(self) -> dict[str, str]:
        return {f.name: f.dataType.simpleString() for f in self.read().schema.fields}

    def data_types(self) -> dict[str, str]:
        """The source-fed columns (everything but the ``_cdc_`` metadata columns)."""
        return {name: kind for name, kind in self.column_types().items() if not name.startswith(METADATA_PREFIX)}

    def table_location(self) -> str:
        """Where the table's files are: the path, or a named table's location (from the catalog, once)."""
        if not self.by_name:
            return self.location
        found = _named_locations.get(self.location)
        if found is None:
            found = str(self.spark.sql(f"DESCRIBE DETAIL {self.sql}").select("location").first()[0])
            if found.startswith("file:") and not found.startswith("file://"):
                found = found[len("file:"):]
            _named_locations[self.location] = found
        return found

    def log(self) -> LogState:
        """The table's newest version, properties and writers' versions, in one read of its log
        (version -1: no table)."""
        if self.by_name and not self.exists():
            return LogState()
        return log_state(self.table_location(), self.storage)

    def properties(self) -> dict[str, str]:
        """The table's properties, from the newest metadata in its log (no ``DESCRIBE DETAIL``, which
        rebuilds the file list for its size figures)."""
        return dict(self.log().configuration)

    def source_state(self, properties: Mapping[str, str] | None = None) -> SourceState | None:
        """None for a Delta table cdc_apply did not create (it is then adopted as it is).
        ``properties``: the table's, when the caller has read them already."""
        text = (self.properties() if properties is None else properties).get(SOURCE_PROPERTY)
        return SourceState.from_json(text) if text else None

    def committed_version(self, app_id: str) -> int | None:
        """The last ``txnVersion`` committed under ``app_id`` (Delta's SetTransaction), or None."""
        return self.committed_versions().get(app_id)

    def committed_versions(self) -> dict[str, int]:
        """Every writer identity's last ``txnVersion`` (Delta's SetTransactions): app id -> version,
        read from the log's files, not by rebuilding the table state with Spark jobs."""
        return {app_id: writer.version for app_id, writer in self.log().writers.items()}

    def log_version(self) -> int:
        """The newest version in the Delta log (-1: no table)."""
        return self.log().version

    def commit_is(self, log_version: int, app_id: str | None, txn_version: int, user_metadata: str) -> bool:
        """Whether the commit ``log_version`` is the one a writer made with these confs: its
        SetTransaction says ``app_id`` -> ``txn_version`` (or, without an app id, its commit info
        carries ``user_metadata``). Reads that one commit file."""
        for action in commit_actions(self.table_location(), log_version, self.storage):
            txn, info = action.get("txn"), action.get("commitInfo")
            if app_id is not None and txn and txn.get("appId") == app_id:
                return int(txn["version"]) == txn_version
            if app_id is None and info is not None:
                return info.get("userMetadata") == user_metadata
        return False

    def clear(self) -> None:
        self.spark.sql(f"DELETE FROM {self.sql}")

    def merge(self, source: DataFrame, condition: str) -> MergeStatement:
        """A ``MERGE INTO`` this table (alias ``t``) from ``source`` (alias ``s``)."""
        return MergeStatement(self, source, condition)

    def compact(self) -> None:
        self.spark.sql(f"OPTIMIZE {self.sql}")

    def history(self, limit: int | None = None) -> list[Any]:
        """``DESCRIBE HISTORY``'s rows, newest first."""
        return self.spark.sql(f"DESCRIBE HISTORY {self.sql}{f' LIMIT {limit}' if limit else ''}").collect()

    def last_commit(self) -> Any:
        """The newest commit's row of ``DESCRIBE HISTORY`` (None: no commit)."""
        newest = self.history(1)
        return newest[0] if newest else None

    def record_version(self, app_id: str, version: int, user_metadata: str) -> None:
        """An empty commit whose only news is ``app_id`` reaching ``version`` (Delta's SetTransaction),
        skipped when ``app_id`` holds ``version`` or later already, as Delta's own check would.

        On a classic session, committed as a ``KnownVersionAppend`` of no files, opened at the log
        version whose SetTransactions were read: an empty append Delta checks is a Spark
        job, and Delta's check may rebuild the table state. Seconds of each table's initial copy."""
        from cdc_apply.apply.sessionconf import delta_write_options

        state = self.log()
        held = state.writers.get(app_id)
        if held is not None and held.version >= version:
            return
        append = self.open_known_version_append(app_id, state.version)
        if append is not None:
            append.commit(version, user_metadata)
            return
        self.write(self.read().limit(0), "append", **delta_write_options(app_id, version, user_metadata))  # Delta checks

    def fence(self, app_id: str) -> None:
        """On a Spark Connect session, before this process first reads ``app_id``'s version here: an
        empty commit one past it, so that a killed client's commit the server finishes cannot land
        after the read (``apply/fence.py``)."""
        fence.fence(self, app_id)

    def append_known_version(self, frame: DataFrame, app_id: str, txn_version: int, user_metadata: str,
                             read_at: int) -> bool:
        """Append ``frame`` in one commit that records ``app_id`` -> ``txn_version`` (a SetTransaction),
        without asking Delta whether ``app_id`` holds that version already (``KnownVersionAppend``).
        Writes nothing and returns False when that path is not open here, the log has moved past
        ``read_at`` or ``frame`` does not fit the table: the caller then writes with the commit
        confs, and Delta checks."""
        append = self.open_known_version_append(app_id, read_at)
        if append is None or not append.write(frame):
            return False
        append.commit(txn_version, user_metadata)
        return True

    def open_known_version_append(self, app_id: str, read_at: int) -> delta_internal.KnownVersionAppend | None:
        """A Delta transaction for an append of ``app_id``'s next version, opened at log version
        ``read_at``; None when the log has moved past it, or on a session without Delta's internals
        (the caller writes through the public path)."""
        if not self.internals:
            return None
        # By its location: Delta's TableIdentifier would take a name's dots as part of the table's name.
        return delta_internal.open_known_version_append(self.spark, self.table_location(), app_id, read_at)

    def open_file_append(self, partition_by: Sequence[str] = (), app_id: str | None = None,
                         read_at: int | None = None, storage: Storage | None = None) -> delta_internal.FileAppend | None:
        """An append of files written outside Delta's writer (``FileAppend``); None when this table
        takes only Delta's writer: a session without Delta's internals, a table by name, a location
        on an object store without the ``storage`` that reaches it (the writers do not share the
        JVM's Hadoop credentials), a table partitioned otherwise than ``partition_by`` (the columns
        the writer puts in the files' directories), a struct column under column mapping (its
        fields have physical names of their own), or what Delta's writer enforces or fills in. With
        ``app_id``, the commit records ``app_id``'s next version as ``KnownVersionAppend`` does, and
        None also when the log has moved past ``read_at``."""
        if not self.internals or self.by_name or (storage is None and not Location.parse(self.location).local):
            return None
        return delta_internal.open_file_append(self.spark, self.location, partition_by, app_id, read_at)

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
        if self.by_name:
            self._refuse_a_catalog_that_forgets()
        try:
            self.spark.sql(f"CREATE TABLE IF NOT EXISTS {self.sql} ({ddl}) USING delta{partitioned} "
                           f"TBLPROPERTIES ({props})")
        except Exception as exc:
            if self.by_name and "SCHEMA_NOT_FOUND" in str(exc):
                # Not created for the user: in a governed catalog (Unity Catalog, Glue) a schema is an
                # administrator's decision, with its own owner, location and grants.
                raise TargetCatalogError(
                    f"{BY_NAME_KEYS}: the target {self.location}: its schema does not exist in the catalog; "
                    f"create it first (CREATE SCHEMA ...), or name a schema that exists") from None
            raise

    def _refuse_a_catalog_that_forgets(self) -> None:
        """A name in Spark's default session catalog when that is the in-memory one: the table would be
        gone from the catalog when the job ends, and the next run would make another (docs/spark.md,
        "Catalog targets"). A name in another configured catalog (``spark.sql.catalog.<name>``) is
        that catalog's business."""
        first = self.location.split(".", 1)[0].strip("`")
        try:
            if first != "spark_catalog" and self.spark.conf.get(f"spark.sql.catalog.{first}", None):
                return
            implementation = self.spark.conf.get("spark.sql.catalogImplementation", "in-memory")
        except Exception:  # a platform that does not show its static confs (serverless) keeps its own catalog
            return
        if implementation == "in-memory":
            raise TargetCatalogError(
                f"{BY_NAME_KEYS}: the target {self.location} is a catalog table, and this Spark session's "
                f"catalog is Spark's in-memory one, which forgets it when the job ends. Configure a persistent "
                f"catalog (spark.sql.catalogImplementation: hive and a metastore, or your platform's catalog; "
                f"docs/spark.md, \"Catalog targets\"), or write by path (without a name)")


def target_at(spark: SparkSession, options: ApplyOptions, location: str, by_name: bool) -> Target:
    """The Delta table at ``location`` (or by name), reached with the pipeline's storage and settings.
    A table by name stages nothing: its catalog's compute need not reach the warehouse's path."""
    return Target(spark, location, by_name, options.storage, options.delta_internals,
                  NO_STAGING if by_name else options.staging)


def sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"




@dataclass
class MergeStatement:
    """A Delta ``MERGE INTO`` as SQL: the target as ``t``, ``source`` as ``s`` (a temporary view for
    the statement). Conditions and assigned values are SQL expressions; assignment keys are quoted
    target columns. The same statement runs on a classic and a Spark Connect session."""

    target: Target
    source: DataFrame
    condition: str
    clauses: list[str] = field(default_factory=list)

    def _when(self, kind: str, condition: str | None, action: str) -> MergeStatement:
        self.clauses.append(f"WHEN {kind}{f' AND {condition}' if condition else ''} THEN {action}")
        return self

    def when_matched_update(self, condition: str | None, assignments: Mapping[str, str]) -> MergeStatement:
        return self._when("MATCHED", condition, "UPDATE SET " + _assignments(assignments))

    def when_matched_update_all(self) -> MergeStatement:
        return self._when("MATCHED", None, "UPDATE SET *")

    def when_matched_delete(self, condition: str | None = None) -> MergeStatement:
        return self._when("MATCHED", condition, "DELETE")

    def when_not_matched_insert(self, condition: str | None, values: Mapping[str, str]) -> MergeStatement:
        columns = ", ".join(values)
        return self._when("NOT MATCHED", condition, f"INSERT ({columns}) VALUES ({', '.join(values.values())})")

    def when_not_matched_insert_all(self) -> MergeStatement:
        return self._when("NOT MATCHED", None, "INSERT *")

    def when_not_matched_by_source_update(self, condition: str | None, assignments: Mapping[str, str]) -> MergeStatement:
        return self._when("NOT MATCHED BY SOURCE", condition, "UPDATE SET " + _assignments(assignments))

    def when_not_matched_by_source_delete(self) -> MergeStatement:
        return self._when("NOT MATCHED BY SOURCE", None, "DELETE")

    def execute(self) -> None:
        # A global temporary view: the source may come from another session of the same Spark
        # application than the target's, whose confs carry the commit's identity.
        spark = self.target.spark
        view = f"_cdc_apply_merge_source_{uuid.uuid4().hex}"
        self.source.createOrReplaceGlobalTempView(view)
        try:
            spark.sql(f"MERGE INTO {self.target.sql} AS t USING global_temp.{view} AS s ON {self.condition} "
                      + " ".join(self.clauses)).collect()
        finally:
            spark.catalog.dropGlobalTempView(view)


def _assignments(assignments: Mapping[str, str]) -> str:
    return ", ".join(f"t.{column} = {value}" for column, value in assignments.items())
