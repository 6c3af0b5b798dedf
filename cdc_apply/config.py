"""YAML config -> typed, validated config. Every key is documented in docs/config.md.

Validation happens before anything starts: unknown keys are refused, and every error names the
key path (``tables."public.orders".delete_mode``) and what is allowed.
"""

from __future__ import annotations

import math
import os
import re
import string
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator

from cdc_apply.config_file import MAX_ECHO_CHARS, read_yaml
from cdc_apply.errors import ConfigError  # noqa: F401 - imported from here too, the path before errors.py


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# PostgreSQL truncates identifiers to NAMEDATALEN - 1 bytes: two longer names could share one slot.
MAX_IDENTIFIER_BYTES = 63
# Bounds that keep a typo (1e35) from reaching the pipeline as a number nothing can honour.
MAX_CHANGES = 100_000_000
# Rows from which a frame is staged as Parquet (apply/staging.py): measured where staging starts to pay
DEFAULT_STAGING_ROWS = 20_000
MAX_SECONDS = 86_400.0
MAX_BYTES = 2**40


def _identifier_length(value: str, what: str) -> str:
    if not value or len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise ValueError(f"{what} must be 1 to {MAX_IDENTIFIER_BYTES} bytes (PostgreSQL truncates longer names, "
                         "so two configs could share one)")
    return value


def _conf_text(value: Any) -> Any:
    """Spark confs and Delta table properties are text; YAML writes numbers and booleans bare
    (``spark.sql.shuffle.partitions: 4``, ``delta.appendOnly: true``): they become the text Spark and
    Delta read (``4``, ``true``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("a number here must be finite")
        return repr(value)
    return value


# A Spark conf's or a Delta property's value: text, or a bare YAML number or boolean written as Spark reads it.
ConfText = Annotated[str, BeforeValidator(_conf_text)]


# libpq settings every source connection gets unless the DSN sets them (docs/operations.md, "Failover").
TCP_DEFAULTS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3",
                "tcp_user_timeout": "30000", "connect_timeout": "10"}


class SourceConfig(_Strict):
    dsn: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(5432, ge=1, le=65535)
    dbname: str = "postgres"
    user: str = "postgres"
    password_env: str | None = None
    password_file: str | None = None
    slot: str = Field("cdc_apply", pattern=r"^[a-z0-9_]+$")  # PostgreSQL's rule for replication slot names
    # One publication or several, as CREATE SUBSCRIPTION ... PUBLICATION a, b takes them.
    publication: str | list[str] = "cdc_apply"
    create_slot: bool = True
    # PostgreSQL 17+: the slot is a failover slot, which a standby with sync_replication_slots keeps a
    # copy of, so the pipeline carries on from it after a promotion (docs/operations.md, "Failover").
    failover: bool = True
    create_publication: bool = False
    publication_tables: list[str] | None = None  # for create_publication; None means FOR ALL TABLES
    proto_version: int | None = Field(None, ge=1, le=4)  # None: the highest the server speaks
    binary: bool = False
    streaming: Literal["off", "on", "parallel"] | None = None  # None: on for v2+, parallel for v4
    two_phase: bool = False
    messages: bool = False
    origin: Literal["any", "none"] | None = None
    skip_origins: list[str] = []
    # Slot health (docs/operations.md): WAL the slot may hold back before on_retained_wal applies.
    max_retained_wal: ByteSize | None = Field(None, ge=1, le=2**62)  # bytes, or "20GB", "512MiB"
    on_retained_wal: Literal["warn", "stop"] = "warn"
    health_interval_seconds: float = Field(30.0, gt=0, le=MAX_SECONDS)
    # How often `run --follow` reports its position to the walsender and asks for a reply; a stream
    # silent for 3 of these counts as stalled and is reconnected (docs/operations.md, "Failover").
    status_interval_seconds: float = Field(10.0, gt=0, le=MAX_SECONDS)

    @field_validator("slot")
    @classmethod
    def _slot_length(cls, value: str) -> str:
        return _identifier_length(value, "a slot name")

    @field_validator("publication")
    @classmethod
    def _publication_length(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if not names:
            raise ValueError("name at least one publication")
        if len(set(names)) != len(names):
            raise ValueError("a publication is named twice")
        for name in names:
            _identifier_length(name, "a publication name")
        return value

    @property
    def publications(self) -> tuple[str, ...]:
        """The publication names, in the config's order."""
        return (self.publication,) if isinstance(self.publication, str) else tuple(self.publication)

    def describe_publications(self) -> str:
        """How messages name the publications: ``publication 'a'`` or ``publications 'a', 'b'``."""
        names = ", ".join(repr(name) for name in self.publications)
        return f"publication{'s' if len(self.publications) > 1 else ''} {names}"

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
        """A libpq connection string. The password never appears in logs: log ``describe()``.

        TCP keepalives, ``tcp_user_timeout`` and ``connect_timeout`` are on unless the DSN sets them: a
        connection whose network path died fails within about 30 s instead of the kernel's 15 minutes."""
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        if self.dsn:
            base = make_conninfo(self.dsn)
        else:
            base = make_conninfo(host=self.host, port=self.port, dbname=self.dbname, user=self.user)
        given = conninfo_to_dict(base)
        extra = {key: value for key, value in TCP_DEFAULTS.items() if key not in given}
        password = self.password()
        if password:
            extra["password"] = password
        return make_conninfo(base, **extra) if extra else base

    def describe(self) -> str:
        if self.dsn:
            from psycopg.conninfo import conninfo_to_dict

            parts = {k: v for k, v in conninfo_to_dict(self.dsn).items() if k != "password"}
            return " ".join(f"{k}={v}" for k, v in parts.items())
        return f"host={self.host} port={self.port} dbname={self.dbname} user={self.user}"


class ColumnConfig(_Strict):
    # "string": PostgreSQL's exact text, for values the mapped type cannot hold (NaN in numeric(p,s),
    # a multi-dimensional array). An existing target column is rewritten to it (docs/apply.md).
    type: Literal["string"]


class TableConfig(_Strict):
    include: bool = True
    keys: list[str] | None = None
    columns_include: list[str] | None = None
    columns_exclude: list[str] = []
    delete_mode: Literal["hard", "soft"] = "hard"
    scd_type: Literal[1, 2] = 1
    schema_policy: Literal["evolve", "lenient", "ignore", "fail"] = "lenient"
    # A widening column (smallint -> int, decimal up, ...): "rewrite" casts the column in one overwrite
    # commit, readable by every reader; "feature" uses Delta's typeWidening (no rewrite; Spark only).
    type_widening: Literal["rewrite", "feature"] = "rewrite"
    partition_by: list[str] = []
    properties: dict[str, ConfText] = {}
    name: str | None = None  # catalog.schema.table instead of a path under the warehouse
    columns: dict[str, ColumnConfig] = {}
    # A MERGE's condition names the batch's keys on the target too, so it reads only the rows (and
    # files) they can be in (apply/key_filter.py); false: the key equality alone.
    key_filter: bool = True


class TargetConfig(_Strict):
    warehouse: str = "./warehouse"
    path_template: str = "{schema}/{table}"
    name_template: str | None = None
    properties: dict[str, ConfText] = {}
    optimize_every_commits: int = Field(100, ge=0, le=1_000_000)  # 0: never
    # On a classic session: two commits through Delta's internal classes (apply/delta_internal.py).
    # false: public APIs only, as on a Spark Connect session.
    delta_internals: bool = True
    # A frame of at least this many rows reaches Spark as a Parquet file under the warehouse, not as
    # rows sent from the driver (apply/staging.py); 0: never.
    staging_rows: int = Field(DEFAULT_STAGING_ROWS, ge=0, le=MAX_CHANGES)

    @field_validator("path_template", "name_template")
    @classmethod
    def _only_schema_and_table(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            parts = list(string.Formatter().parse(value))
        except ValueError as exc:
            raise ValueError(f"not a valid template: {exc}") from None
        fields = [(name, spec, conversion) for _, name, spec, conversion in parts if name is not None]
        if any(name not in ("schema", "table") or spec or conversion for name, spec, conversion in fields) \
                or "table" not in {name for name, _, _ in fields}:
            raise ValueError("may use only plain {schema} and {table} (no conversion or format spec), "
                             "and must use {table}")
        return value

    @field_validator("path_template")
    @classmethod
    def _stays_under_warehouse(cls, value: str) -> str:
        literal = "".join(text for text, _, _, _ in string.Formatter().parse(value))
        if "\\" in value or "\0" in value or value.startswith("/") or re.match(r"^[A-Za-z]:", value):
            raise ValueError("must be a relative path under the warehouse (no leading '/', drive or backslash)")
        if any(part in ("..", ".") for part in PurePosixPath(value).parts) or ".." in literal.split("/"):
            raise ValueError("must stay under the warehouse: no '.' or '..' path component")
        return value

    @field_validator("warehouse")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a directory path")
        return value


class BatchingConfig(_Strict):
    max_changes: int = Field(200_000, ge=1, le=MAX_CHANGES)
    max_seconds: float = Field(10.0, gt=0, le=MAX_SECONDS)
    spill_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=MAX_BYTES)
    parallel_tables: int = Field(4, ge=1, le=64)  # tables of one batch applied at once, each in its own session
    write_retry_seconds: float = Field(120.0, ge=0, le=MAX_SECONDS)  # run --follow: how long failed writes are tried again


class SnapshotConfig(_Strict):
    enabled: bool = True  # copy each published table before streaming its changes
    # spark: page ranges read and written by Spark's tasks in parallel; driver: one COPY stream read
    # on the driver in key order, a chunk per commit (docs/live.md, "Initial copy").
    method: Literal["spark", "driver"] = "spark"
    chunk_rows: int = Field(100_000, ge=1, le=MAX_CHANGES)  # rows converted at once (per task, or per driver commit)
    parallelism: int | None = Field(None, ge=1, le=10_000)  # None: Spark's default parallelism
    max_connections: int = Field(8, ge=1, le=10_000)  # at most this many tasks (each a connection) at once
    range_pages: int = Field(4096, ge=1, le=2**31 - 1)  # heap pages per range: 32 MB of 8 kB pages
    ranges_per_commit: int = Field(64, ge=1, le=1_000_000)  # ranges per Delta commit: what a resumed copy keeps
    # tasks: the tasks write the Parquet files themselves (pyarrow) and the driver commits them, with
    # their row counts and the exact min/max of integer and date columns as statistics; delta: Delta's
    # own writer, with min/max of the first 32 columns, about half as fast (docs/live.md, "Initial
    # copy on Spark's executors").
    file_writer: Literal["tasks", "delta"] = "tasks"


class ChangelogConfig(_Strict):
    """The change log: every batch's change rows in one Delta table (docs/change-log-table.md)."""

    enabled: bool = False
    path: str | None = None  # None: <target.warehouse>/_cdc_apply/changelog
    name: str | None = None  # a catalog table (schema.table) instead of a path
    # targets: the slot is confirmed once the targets hold a batch (the log is written first).
    # changelog: once the log's commit is durable; the targets follow from the log in the same
    # process (docs/change-log-table.md, "Choosing confirm_after").
    confirm_after: Literal["targets", "changelog"] = "targets"
    # confirm_after: changelog only. in_process: the run's own thread brings the targets up from the log.
    # separate: cdc-apply follow-changelog does (a Structured Streaming query over the log); the run
    # only copies new tables and appends to the log.
    targets: Literal["in_process", "separate"] = "in_process"

    @property
    def follower(self) -> Literal["in_process", "separate"] | None:
        """Who brings the targets up from the log; None when the run applies every batch itself."""
        return self.targets if self.enabled and self.confirm_after == "changelog" else None

    @model_validator(mode="after")
    def _one_place(self) -> ChangelogConfig:
        if self.path is not None and self.name is not None:
            raise ValueError("give changelog.path or changelog.name, not both")
        if self.confirm_after == "changelog" and not self.enabled:
            raise ValueError("changelog.confirm_after: changelog needs changelog.enabled: true")
        if self.targets == "separate" and self.confirm_after != "changelog":
            raise ValueError("changelog.targets: separate needs changelog.confirm_after: changelog (with "
                             "confirm_after: targets the run applies every batch to the targets itself)")
        return self


class StreamConfig(_Strict):
    """``cdc-apply stream`` / jobs/stream_changes.py: Structured Streaming over format("pgoutput")."""

    checkpoint_location: str | None = None  # None: <warehouse>/_cdc_apply/checkpoints/<pipeline>
    trigger: Literal["processing_time", "available_now"] = "processing_time"
    interval_seconds: float = Field(5.0, gt=0, le=MAX_SECONDS)  # processing_time: time between micro-batch starts
    max_changes_per_trigger: int | None = Field(None, ge=1, le=MAX_CHANGES)  # None: batching.max_changes


class MetricsConfig(_Strict):
    """Prometheus metrics and /healthz of `run --follow` and `stream` (docs/operations.md)."""

    port: int | None = Field(None, ge=0, le=65535)  # None: off; 0: any free port (logged)
    host: str = "127.0.0.1"


class Config(_Strict):
    pipeline: str = Field("cdc_apply", pattern=r"^[A-Za-z0-9_.\-]+$")
    source: SourceConfig = SourceConfig()
    target: TargetConfig = TargetConfig()
    defaults: TableConfig = TableConfig()
    tables: dict[str, TableConfig] = {}
    batching: BatchingConfig = BatchingConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
    changelog: ChangelogConfig = ChangelogConfig()
    stream: StreamConfig = StreamConfig()
    metrics: MetricsConfig = MetricsConfig()
    spark: dict[str, ConfText] = {}


_SECRET_KEY = re.compile(r"pass|secret|token|credential|private|auth", re.IGNORECASE)
_SECRET_TEXT = re.compile(r"password|secret|token|://[^\s@]*:[^\s@]*@", re.IGNORECASE)


def _key_path(location: tuple[Any, ...]) -> str:
    parts = []
    for part in location:
        text = str(part)[:MAX_ECHO_CHARS]
        parts.append(f'"{text}"' if any(c in text for c in ".* ") else text)
    return ".".join(parts) or "(top level)"


def _echo(location: tuple[Any, ...], value: Any, unknown_key: bool) -> str:
    """What an error may show of the offending value: never the value of an unknown key (it may be
    a secret put in the wrong place), never one under or looking like a secret, and never much."""
    if unknown_key or any(_SECRET_KEY.search(str(part)) for part in location):
        return ""
    if isinstance(value, (dict, list)):
        return f" (got a {'mapping' if isinstance(value, dict) else 'list'})"
    text = repr(value)
    if _SECRET_TEXT.search(text):
        return " (value not shown: it looks like a secret)"
    return f" (got {text[:MAX_ECHO_CHARS]}{'...' if len(text) > MAX_ECHO_CHARS else ''})"


def parse_config(data: Any, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys, not {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        errors = exc.errors()
        for error in errors[:MAX_REPORTED_ERRORS]:
            message = error["msg"].removeprefix("Value error, ")
            unknown = error["type"] == "extra_forbidden"
            if unknown:
                message = "unknown key"
            elif error["type"] == "literal_error":
                message = f"must be one of {error['ctx']['expected']}"
            lines.append(f"{source}: {_key_path(error['loc'])}: {message}{_echo(error['loc'], error.get('input'), unknown)}")
        if len(errors) > MAX_REPORTED_ERRORS:
            lines.append(f"{source}: ... and {len(errors) - MAX_REPORTED_ERRORS} more error(s)")
        raise ConfigError("\n".join(lines)) from None


MAX_REPORTED_ERRORS = 20


def load_config(path: str | Path) -> Config:
    """The config in the YAML file ``path`` (read by ``config_file.read_yaml``), validated."""
    path = Path(path)
    return parse_config(read_yaml(path), str(path))

