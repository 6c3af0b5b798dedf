"""What the apply needs to know about each target: the typed, already-validated per-table options.

The YAML config (``cdc_apply.config``) produces these; the library and notebooks can build them
directly. Defaults are what a data engineer expects: hard deletes, no history, lenient schema policy.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from cdc_apply.apply.staging import Staging, pipeline_staging
from cdc_apply.config import DEFAULT_STAGING_ROWS
from cdc_apply.errors import CdcApplyError
from cdc_apply.lake.location import PATH_ESCAPE, Location, Storage, path_component  # noqa: F401 - re-exported
from cdc_apply.lake.state import PipelineState

if TYPE_CHECKING:
    from cdc_apply.config import Config, TableConfig

DeleteMode = Literal["hard", "soft"]
SchemaPolicy = Literal["evolve", "lenient", "ignore", "fail"]

DELETE_MODES: tuple[str, ...] = ("hard", "soft")
SCHEMA_POLICIES: tuple[str, ...] = ("evolve", "lenient", "ignore", "fail")

METADATA_PREFIX = "_cdc_"
COMMIT_LSN = "_cdc_commit_lsn"
COMMIT_TS = "_cdc_commit_ts"
DELETED = "_cdc_deleted"
# Columns of a MERGE source only: the key's operation (U upsert, D delete) and the columns an upsert
# leaves as the target holds them.
OP, KEEP = "_cdc_op", "_cdc_keep"
VALID_FROM = "_cdc_valid_from"
VALID_TO = "_cdc_valid_to"
CURRENT = "_cdc_current"


class TargetPathError(CdcApplyError):
    """A target location that would lie outside the warehouse."""




@dataclass(frozen=True)
class TableOptions:
    keys: tuple[str, ...] | None = None  # overrides the replica identity
    delete_mode: DeleteMode = "hard"
    scd_type: Literal[1, 2] = 1
    schema_policy: SchemaPolicy = "lenient"
    type_widening: Literal["rewrite", "feature"] = "rewrite"
    include: bool = True
    columns_include: tuple[str, ...] | None = None
    columns_exclude: tuple[str, ...] = ()
    partition_by: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None  # a metastore name (catalog.schema.table) instead of a path
    column_types: Mapping[str, str] = field(default_factory=dict)  # source column -> "string" (its exact text)
    key_filter: bool = True  # a MERGE reads only the rows its keys can be in (apply/key_filter.py)

    def keeps_column(self, column: str) -> bool:
        if column in self.columns_exclude:
            return False
        return self.columns_include is None or column in self.columns_include


MAX_PIECE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ApplyOptions:
    """``tables`` maps ``schema.table`` patterns (fnmatch, first match wins) to their options."""

    warehouse: str
    pipeline: str = "cdc_apply"
    tables: Mapping[str, TableOptions] = field(default_factory=dict)
    defaults: TableOptions = field(default_factory=TableOptions)
    table_properties: Mapping[str, str] = field(default_factory=dict)
    parallel_tables: int = 1
    path_template: str = "{schema}/{table}"  # under the warehouse
    name_template: str | None = None  # a catalog table name instead of a path, e.g. "lake.{schema}_{table}"
    storage: Storage = field(default_factory=Storage)  # how Python reaches the warehouse's store (its state)
    optimize_every_commits: int = 0  # compact a target's small files when its log version crosses a multiple
    # A spilled transaction is appended in pieces of at most this many bytes of messages: the driver
    # holds one piece's change rows at a time, about 4x its size (docs/live.md, "Memory").
    piece_bytes: int = MAX_PIECE_BYTES
    # Delta's internal classes for two commits on a classic session (apply/delta_internal.py).
    delta_internals: bool = True
    # Frames of at least this many rows reach Spark as Parquet files (apply/staging.py); 0: never.
    staging_rows: int = DEFAULT_STAGING_ROWS

    def default_target(self, schema: str, table: str) -> tuple[str, bool]:
        """(location, by_name) of a table's target when its options name none.

        A path is built from the identifiers encoded by ``path_component``, and must lie under the
        warehouse: an identifier may hold any character, ``/`` and ``..`` included.
        """
        if self.name_template is not None:
            return self.name_template.format(schema=schema, table=table), True
        relative = self.path_template.format(schema=path_component(schema), table=path_component(table))
        try:
            return str(self.warehouse_location.under(relative)), False
        except ValueError as exc:
            raise TargetPathError(f"target.path_template: the target of {schema!r}.{table!r} is not under the "
                                  f"warehouse {self.warehouse_location}: {exc}") from None

    @property
    def warehouse_location(self) -> Location:
        return Location.parse(self.warehouse)

    @property
    def state(self) -> PipelineState:
        """The pipeline's own state, beside its targets (``cdc_apply/lake/state.py``)."""
        return PipelineState(self.warehouse_location, self.pipeline, self.storage)

    @property
    def staging(self) -> Staging:
        """Where this pipeline's large frames are staged (``<warehouse>/_cdc_apply/staging/<pipeline>``)."""
        return pipeline_staging(self.state, self.staging_rows)

    def column_type(self, schema: str, table: str, column: str) -> str | None:
        """The type the config sets for a source column (``tables.<t>.columns.<c>.type``), or None."""
        return self.for_table(schema, table).column_types.get(column)

    def for_table(self, schema: str, table: str) -> TableOptions:
        qualified = f"{schema}.{table}"
        for pattern, options in self.tables.items():
            if fnmatch.fnmatchcase(qualified, pattern):
                return options
        return self.defaults


def table_options(table: TableConfig) -> TableOptions:
    """A config's per-table section as the apply's options."""
    return TableOptions(
        keys=tuple(table.keys) if table.keys else None, delete_mode=table.delete_mode, scd_type=table.scd_type,
        schema_policy=table.schema_policy, type_widening=table.type_widening, include=table.include,
        columns_include=tuple(table.columns_include) if table.columns_include is not None else None,
        columns_exclude=tuple(table.columns_exclude), partition_by=tuple(table.partition_by),
        properties=dict(table.properties), name=table.name,
        column_types={name: column.type for name, column in table.columns.items()}, key_filter=table.key_filter)


def apply_options(config: Config) -> ApplyOptions:
    """What the apply needs of a validated config."""
    return ApplyOptions(warehouse=config.target.warehouse, pipeline=config.pipeline,
                        tables={pattern: table_options(table) for pattern, table in config.tables.items()},
                        defaults=table_options(config.defaults), table_properties=dict(config.target.properties),
                        parallel_tables=config.batching.parallel_tables,
                        path_template=config.target.path_template, name_template=config.target.name_template,
                        optimize_every_commits=config.target.optimize_every_commits,
                        piece_bytes=min(MAX_PIECE_BYTES, config.batching.spill_bytes),
                        delta_internals=config.target.delta_internals, staging_rows=config.target.staging_rows,
                        storage=Storage.from_spark_conf(config.spark))
