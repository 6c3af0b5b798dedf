"""``cdc-apply stream``: a Structured Streaming query from the YAML config.

``spark.readStream.format("pgoutput")`` with the config's ``source`` keys as options, written
with ``foreachBatch(foreach_batch(config))``, checkpointed at ``stream.checkpoint_location``.
On SIGTERM/SIGINT the running micro-batch finishes, then the query stops (exit 0).

While it runs, the slot's health is checked every ``source.health_interval_seconds`` (an unusable
slot stops the query), and with ``metrics.port`` the metrics and ``/healthz`` are served: the
liveness beat is a finished trigger, or an idle query.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Literal, overload

import psycopg

from cdc_apply.apply.session_kind import is_connect
from cdc_apply.changelog.follower import TargetFollower
from cdc_apply.config import Config, ConfigError, SourceConfig
from cdc_apply.lake.location import Location, path_component
from cdc_apply.lake.state import STATE_DIRECTORY
from cdc_apply.metrics import MetricsServer, PipelineMetrics
from cdc_apply.parts import run_parts
from cdc_apply.pipeline import prepare_source
from cdc_apply.runtime import StopFlag, await_query
from cdc_apply.sources.health import HealthMonitor
from cdc_apply.sink import RunSummary
from cdc_apply.spark.datasource import register as register_pgoutput
from cdc_apply.spark.foreach import foreach_batch

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery

log = logging.getLogger(__name__)


def source_options(source: SourceConfig, max_changes_per_trigger: int | None = None) -> dict[str, str]:
    """The config's ``source`` keys as data source options (the password stays in its env var or file)."""
    options: dict[str, str] = {}
    for name, value in source.model_dump(exclude_defaults=True).items():
        if isinstance(value, bool):
            options[name] = str(value).lower()
        elif isinstance(value, list):
            options[name] = ",".join(value)
        elif value is not None:
            options[name] = str(value)
    if max_changes_per_trigger is not None:
        options["maxChangesPerTrigger"] = str(max_changes_per_trigger)
    return options


def offset_lsn(offset: dict[str, Any] | str | None) -> str:
    """The LSN of a progress report's offset (Spark gives it as a dict or as its JSON text)."""
    if offset is None:
        return "-"
    if isinstance(offset, str):
        offset = json.loads(offset)
    return str(offset.get("lsn", "-")) if isinstance(offset, dict) else "-"


def checkpoint_location(config: Config) -> str:
    return config.stream.checkpoint_location or str(
        Location.parse(config.target.warehouse).child(STATE_DIRECTORY, "checkpoints", path_component(config.pipeline)))


@overload
def start_stream(config: Config, spark: SparkSession) -> StreamingQuery: ...
@overload
def start_stream(config: Config, spark: SparkSession, with_function: Literal[True]) -> tuple[StreamingQuery, Any]: ...


def start_stream(config: Config, spark: SparkSession, with_function: bool = False,
                 metrics: PipelineMetrics | None = None) -> Any:
    """The query; with ``with_function`` also its foreach_batch function (``.summary``: batches, lag;
    ``.follower``: under ``changelog.confirm_after: changelog`` with ``targets: in_process``, the
    running thread that brings the targets up from the change log, which the caller stops)."""
    limit = config.stream.max_changes_per_trigger or config.batching.max_changes
    register_pgoutput(spark)
    reader = spark.readStream.format("pgoutput").options(**source_options(config.source, limit))
    parts = run_parts(config, spark, RunSummary(metrics=metrics), sink_copies=False)
    sink, follower = parts.sink, parts.follower
    if sink.changelog is not None:
        sink.changelog.ensure()  # on this thread, before the follower reads it
    if is_connect(spark):
        # The function runs in the Connect server's Python worker: it carries no client session and
        # makes its sink there, at the first micro-batch, in the query's session.
        if sink.changelog is not None:
            raise ConfigError("changelog.enabled: the change log is kept by `cdc-apply stream` on a classic "
                              "session only; on Spark Connect use `cdc-apply run --follow` for it")
        apply = foreach_batch(config)
    else:
        apply = foreach_batch(config, metrics=metrics, sink=sink)
    apply.follower = follower  # type: ignore[attr-defined]
    writer = (reader.load().writeStream.foreachBatch(apply).queryName(config.pipeline)
              .option("checkpointLocation", checkpoint_location(config)))
    if config.stream.trigger == "available_now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.stream.interval_seconds} seconds")
    query = writer.start()
    if follower is not None:
        follower.start()
    log.info("streaming query %s (id %s) started, checkpoint %s", config.pipeline, query.id,
             checkpoint_location(config))
    return (query, apply) if with_function else query


STREAM_BEAT_FLOOR_S = 30.0


def stream_beat_interval(config: Config) -> float:
    """How long a trigger may take before /healthz calls the query wedged (half of it, doubled there)."""
    return max(config.stream.interval_seconds, STREAM_BEAT_FLOOR_S)


def run_stream(config: Config, spark: SparkSession, stop: StopFlag,
               metrics: PipelineMetrics | None = None) -> list[dict[str, Any]]:
    """Runs until the query ends (available_now) or a stop is asked; returns the batches' progress."""
    metrics = metrics or PipelineMetrics(config.pipeline, stream_beat_interval(config))
    health = HealthMonitor(config.source, metrics)
    prepare_source(config)  # what the data source would create, and the slot's health, before the query starts
    query, apply = start_stream(config, spark, with_function=True, metrics=metrics)
    follower: TargetFollower | None = apply.follower
    server: MetricsServer | None = None
    last_progress: object = None
    def tick() -> None:
        nonlocal last_progress
        progress = query.lastProgress
        stamp = progress["timestamp"] if progress else None
        if stamp != last_progress or not query.status["isTriggerActive"]:
            metrics.beat()
            last_progress = stamp
        if health.due():
            _check_health(config, health)
        if follower is not None:
            follower.raise_error()

    try:
        if config.metrics.port is not None:
            server = MetricsServer(metrics, config.metrics.host, config.metrics.port)
        await_query(query, stop, tick)
        if follower is not None and config.stream.trigger == "available_now":
            _wait_for_the_targets(follower, stop)
    except BaseException as exc:
        metrics.error(exc)
        raise
    finally:
        if query.isActive:
            query.stop()
        if follower is not None:
            follower.stop()
        if server is not None:
            server.close()
    return [progress for progress in query.recentProgress if progress["numInputRows"] or progress["batchId"] == 0]


def _wait_for_the_targets(follower: TargetFollower, stop: StopFlag) -> None:
    """An ``available_now`` run ends with the targets holding what the change log holds (unless
    stopped first: the next run's follower applies the rest)."""
    logged = follower.applier.changelog.version
    while logged is not None and not stop.event.is_set() and not follower.wait_for(logged, timeout=0.5):
        follower.raise_error()


def _check_health(config: Config, health: HealthMonitor) -> None:
    """A slot problem stops the query; a server that cannot be reached now is the data source's
    business (its next trigger fails or succeeds), so the check just waits for the next interval."""
    try:
        with psycopg.connect(config.source.conninfo(), autocommit=True, connect_timeout=10) as conn:
            health.check(conn)
    except psycopg.OperationalError as exc:
        log.warning("slot health check skipped: %s", " ".join(str(exc).split()))
