"""What the apply needs to know about each target: the typed, already-validated per-table options.

The YAML config (``cdc_apply.config``) produces these; the library and notebooks can build them
directly. Defaults are what a data engineer expects: hard deletes, no history, lenient schema policy.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DeleteMode = Literal["hard", "soft"]
SchemaPolicy = Literal["evolve", "lenient", "ignore", "fail"]

DELETE_MODES: tuple[str, ...] = ("hard", "soft")
SCHEMA_POLICIES: tuple[str, ...] = ("evolve", "lenient", "ignore", "fail")

METADATA_PREFIX = "_cdc_"
COMMIT_LSN = "_cdc_commit_lsn"
COMMIT_TS = "_cdc_commit_ts"
DELETED = "_cdc_deleted"
VALID_FROM = "_cdc_valid_from"
VALID_TO = "_cdc_valid_to"
CURRENT = "_cdc_current"


@dataclass(frozen=True)
class TableOptions:
    keys: tuple[str, ...] | None = None  # overrides the replica identity
    delete_mode: DeleteMode = "hard"
    scd_type: Literal[1, 2] = 1
    schema_policy: SchemaPolicy = "lenient"
    include: bool = True
    columns_include: tuple[str, ...] | None = None
    columns_exclude: tuple[str, ...] = ()
    partition_by: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None  # a metastore name (catalog.schema.table) instead of a path

    def keeps_column(self, column: str) -> bool:
        if column in self.columns_exclude:
            return False
        return self.columns_include is None or column in self.columns_include


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

    def default_target(self, schema: str, table: str) -> tuple[str, bool]:
        """(location, by_name) of a table's target when its options name none."""
        if self.name_template is not None:
            return self.name_template.format(schema=schema, table=table), True
        return str(Path(self.warehouse) / self.path_template.format(schema=schema, table=table)), False

    def for_table(self, schema: str, table: str) -> TableOptions:
        qualified = f"{schema}.{table}"
        for pattern, options in self.tables.items():
            if fnmatch.fnmatchcase(qualified, pattern):
                return options
        return self.defaults
