"""YAML config -> typed, validated config. Every key is documented in docs/config.md.

Validation happens before anything starts: unknown keys are refused, and every error names the
key path (``tables."public.orders".delete_mode``) and what is allowed.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cdc_apply.apply.options import ApplyOptions, TableOptions
from cdc_apply.errors import CdcApplyError


class ConfigError(CdcApplyError):
    """A config that cannot be used; the message names the file and the key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(_Strict):
    dsn: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(5432, ge=1, le=65535)
    dbname: str = "postgres"
    user: str = "postgres"
    password_env: str | None = None
    password_file: str | None = None
    slot: str = "cdc_apply"
    publication: str = "cdc_apply"
    create_slot: bool = True
    create_publication: bool = False
    publication_tables: list[str] | None = None  # for create_publication; None means FOR ALL TABLES
    proto_version: int | None = Field(None, ge=1, le=4)  # None: the highest the server speaks
    binary: bool = False
    streaming: Literal["off", "on", "parallel"] | None = None  # None: on for v2+, parallel for v4
    two_phase: bool = False
    messages: bool = False
    origin: Literal["any", "none"] | None = None
    skip_origins: list[str] = []

    @model_validator(mode="after")
    def _one_password_source(self) -> SourceConfig:
        if self.password_env and self.password_file:
            raise ValueError("set password_env or password_file, not both")
        return self

    def password(self) -> str | None:
        if self.password_env:
            if self.password_env not in os.environ:
                raise ConfigError(f"source.password_env: environment variable {self.password_env} is not set")
            return os.environ[self.password_env]
        if self.password_file:
            try:
                return Path(self.password_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"source.password_file: cannot read {self.password_file}: {exc.strerror}") from None
        return None

    def conninfo(self) -> str:
        """A libpq connection string. The password never appears in logs: log ``describe()``."""
        from psycopg.conninfo import make_conninfo

        if self.dsn:
            base = make_conninfo(self.dsn)
        else:
            base = make_conninfo(host=self.host, port=self.port, dbname=self.dbname, user=self.user)
        password = self.password()
        return make_conninfo(base, password=password) if password else base

    def describe(self) -> str:
        if self.dsn:
            from psycopg.conninfo import conninfo_to_dict

            parts = {k: v for k, v in conninfo_to_dict(self.dsn).items() if k != "password"}
            return " ".join(f"{k}={v}" for k, v in parts.items())
        return f"host={self.host} port={self.port} dbname={self.dbname} user={self.user}"


class TableConfig(_Strict):
    include: bool = True
    keys: list[str] | None = None
    columns_include: list[str] | None = None
    columns_exclude: list[str] = []
    delete_mode: Literal["hard", "soft"] = "hard"
    scd_type: Literal[1, 2] = 1
    schema_policy: Literal["evolve", "lenient", "ignore", "fail"] = "lenient"
    partition_by: list[str] = []
    properties: dict[str, str] = {}
    name: str | None = None  # catalog.schema.table instead of a path under the warehouse

    def options(self) -> TableOptions:
        return TableOptions(
            keys=tuple(self.keys) if self.keys else None, delete_mode=self.delete_mode, scd_type=self.scd_type,
            schema_policy=self.schema_policy, include=self.include,
            columns_include=tuple(self.columns_include) if self.columns_include is not None else None,
            columns_exclude=tuple(self.columns_exclude), partition_by=tuple(self.partition_by),
            properties=dict(self.properties), name=self.name)


class TargetConfig(_Strict):
    warehouse: str = "./warehouse"
    path_template: str = "{schema}/{table}"
    name_template: str | None = None
    properties: dict[str, str] = {}

    @field_validator("path_template", "name_template")
    @classmethod
    def _only_schema_and_table(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            raise ValueError(f"not a valid template: {exc}") from None
        unknown = fields - {"schema", "table"}
        if unknown or "table" not in fields:
            raise ValueError("may use only {schema} and {table}, and must use {table}")
        return value

    @field_validator("warehouse")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a directory path")
        return value


class BatchingConfig(_Strict):
    max_changes: int = Field(200_000, ge=1)
    max_seconds: float = Field(10.0, gt=0)
    spill_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    parallel_tables: int = Field(4, ge=1, le=64)  # tables of one batch applied at once, each in its own session


class SnapshotConfig(_Strict):
    enabled: bool = True  # copy each published table before streaming its changes
    chunk_rows: int = Field(100_000, ge=1)


class StreamConfig(_Strict):
    """``cdc-apply stream`` / jobs/stream_changes.py: Structured Streaming over format("pgoutput")."""

    checkpoint_location: str | None = None  # None: <warehouse>/_cdc_apply/checkpoints/<pipeline>
    trigger: Literal["processing_time", "available_now"] = "processing_time"
    interval_seconds: float = Field(5.0, gt=0)  # processing_time: time between micro-batch starts
    max_changes_per_trigger: int | None = Field(None, ge=1)  # None: batching.max_changes


class Config(_Strict):
    pipeline: str = Field("cdc_apply", pattern=r"^[A-Za-z0-9_.\-]+$")
    source: SourceConfig = SourceConfig()
    target: TargetConfig = TargetConfig()
    defaults: TableConfig = TableConfig()
    tables: dict[str, TableConfig] = {}
    batching: BatchingConfig = BatchingConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
    stream: StreamConfig = StreamConfig()
    spark: dict[str, str] = {}

    def apply_options(self) -> ApplyOptions:
        return ApplyOptions(warehouse=self.target.warehouse, pipeline=self.pipeline,
                            parallel_tables=self.batching.parallel_tables,
                            path_template=self.target.path_template, name_template=self.target.name_template,
                            tables={pattern: table.options() for pattern, table in self.tables.items()},
                            defaults=self.defaults.options(), table_properties=dict(self.target.properties))


def _key_path(location: tuple[Any, ...]) -> str:
    parts = []
    for part in location:
        text = str(part)
        parts.append(f'"{text}"' if any(c in text for c in ".* ") else text)
    return ".".join(parts) or "(top level)"


def parse_config(data: Any, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys, not {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            elif error["type"] == "literal_error":
                message = f"must be one of {error['ctx']['expected']}"
            lines.append(f"{source}: {_key_path(error['loc'])}: {message} (got {error.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, str(path))
