"""What the apply needs to know about each target: the typed, already-validated per-table options.

The YAML config (``cdc_apply.config``) produces these; the library and notebooks can build them
directly. Defaults are what a data engineer expects: hard deletes, no history, lenient schema policy.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cdc_apply.errors import CdcApplyError

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


# The escape itself, path separators, what Hadoop paths or globs read specially (":" makes a URI
# scheme) and "%", which delta-rs percent-decodes in a table's path (so "%" cannot be the escape).
PATH_ESCAPE = "~"
_ENCODED_PATH_CHARACTERS = frozenset('~%/\\:*?[]{}#"<>|')


def path_component(identifier: str) -> str:
    """A PostgreSQL identifier as one safe path component, injectively (docs/apply.md, "Target paths").

    Printable characters stay as they are, so ``public``, ``order_items`` and ``Mixed Case`` keep
    their names; ``~`` (the escape), ``%``, path separators, characters Hadoop paths and globs read
    specially, anything unprintable and a leading dot become ``~XX`` per UTF-8 byte: ``..`` becomes
    ``~2E.``, ``a/b`` becomes ``a~2Fb``.
    """
    out = []
    for position, character in enumerate(identifier):
        if character in _ENCODED_PATH_CHARACTERS or not character.isprintable() or (character == "." and position == 0):
            out.append("".join(f"{PATH_ESCAPE}{byte:02X}" for byte in character.encode("utf-8", "surrogatepass")))
        else:
            out.append(character)
    return "".join(out) or PATH_ESCAPE  # an empty name (never a PostgreSQL one): "~" alone, which no name encodes to


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
    optimize_every_commits: int = 0  # compact a target's small files when its log version crosses a multiple
    # A spilled transaction is appended in pieces of at most this many bytes of messages: the driver
    # holds one piece's change rows at a time, about 4x its size (docs/live.md, "Memory").
    piece_bytes: int = MAX_PIECE_BYTES

    def default_target(self, schema: str, table: str) -> tuple[str, bool]:
        """(location, by_name) of a table's target when its options name none.

        A path is built from the identifiers encoded by ``path_component``, and must lie under the
        warehouse: an identifier may hold any character, ``/`` and ``..`` included.
        """
        if self.name_template is not None:
            return self.name_template.format(schema=schema, table=table), True
        relative = self.path_template.format(schema=path_component(schema), table=path_component(table))
        warehouse = Path(self.warehouse).absolute()
        location = Path(os.path.normpath(warehouse / relative))
        if location == warehouse or not location.is_relative_to(warehouse) or Path(relative).is_absolute():
            raise TargetPathError(f"target.path_template: the target of {schema!r}.{table!r} would be {location}, "
                                  f"which is not under the warehouse {warehouse}")
        return str(Path(self.warehouse) / relative), False

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
        column_types={name: column.type for name, column in table.columns.items()})


def apply_options(config: Config) -> ApplyOptions:
    """What the apply needs of a validated config."""
    return ApplyOptions(warehouse=config.target.warehouse, pipeline=config.pipeline,
                        parallel_tables=config.batching.parallel_tables,
                        path_template=config.target.path_template, name_template=config.target.name_template,
                        tables={pattern: table_options(table) for pattern, table in config.tables.items()},
                        defaults=table_options(config.defaults), table_properties=dict(config.target.properties),
                        optimize_every_commits=config.target.optimize_every_commits,
                        piece_bytes=min(MAX_PIECE_BYTES, config.batching.spill_bytes))
