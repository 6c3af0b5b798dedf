"""``cdc-apply stream``: a Structured Streaming query from the YAML config.

``spark.readStream.format("pgoutput")`` with the config's ``source`` keys as options, written
with ``foreachBatch(foreach_batch(config))``, checkpointed at ``stream.checkpoint_location``.
On SIGTERM/SIGINT the running micro-batch finishes, then the query stops (exit 0).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from cdc_apply.spark.foreach import foreach_batch
from cdc_apply.config import Config, SourceConfig
from cdc_apply.pipeline import StopFlag

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
    return config.stream.checkpoint_location or str(Path(config.target.warehouse) / "_cdc_apply" / "checkpoints"
                                                    / config.pipeline)


@overload
def start_stream(config: Config, spark: SparkSession) -> StreamingQuery: ...
@overload
def start_stream(config: Config, spark: SparkSession, with_function: Literal[True]) -> tuple[StreamingQuery, Any]: ...


def start_stream(config: Config, spark: SparkSession, with_function: bool = False) -> Any:
    """The query; with ``with_function`` also its foreach_batch function (``.summary``: batches, lag)."""
    limit = config.stream.max_changes_per_trigger or config.batching.max_changes
    reader = spark.readStream.format("pgoutput").options(**source_options(config.source, limit))
    apply = foreach_batch(config)
    writer = (reader.load().writeStream.foreachBatch(apply).queryName(config.pipeline)
              .option("checkpointLocation", checkpoint_location(config)))
    if config.stream.trigger == "available_now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.stream.interval_seconds} seconds")
    query = writer.start()
    log.info("streaming query %s (id %s) started, checkpoint %s", config.pipeline, query.id,
             checkpoint_location(config))
    return (query, apply) if with_function else query


def run_stream(config: Config, spark: SparkSession, stop: StopFlag) -> list[dict[str, Any]]:
    """Runs until the query ends (available_now) or a stop is asked; returns the batches' progress."""
    query = start_stream(config, spark)
    try:
        while query.isActive:
            if stop.event.wait(0.5):
                while query.status["isTriggerActive"]:  # let the running micro-batch commit
                    time.sleep(0.2)
                query.stop()
                break
        if query.exception() is not None:
            raise query.exception()  # type: ignore[misc]
    finally:
        if query.isActive:
            query.stop()
    return [progress for progress in query.recentProgress if progress["numInputRows"] or progress["batchId"] == 0]
