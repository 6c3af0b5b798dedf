"""``cdc-apply stream``: a Structured Streaming query from the YAML config.

``spark.readStream.format("pgoutput")`` with the config's ``source`` keys as options, written
with ``foreachBatch(foreach_batch(config))``, checkpointed at ``stream.checkpoint_location``.
On SIGTERM/SIGINT the running micro-batch finishes, then the query stops (exit 0).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cdc_apply.apply.foreach import foreach_batch
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


def checkpoint_location(config: Config) -> str:
    return config.stream.checkpoint_location or str(Path(config.target.warehouse) / "_cdc_apply" / "checkpoints"
                                                    / config.pipeline)


def start_stream(config: Config, spark: SparkSession) -> StreamingQuery:
    limit = config.stream.max_changes_per_trigger or config.batching.max_changes
    reader = spark.readStream.format("pgoutput").options(**source_options(config.source, limit))
    writer = (reader.load().writeStream.foreachBatch(foreach_batch(config)).queryName(config.pipeline)
              .option("checkpointLocation", checkpoint_location(config)))
    if config.stream.trigger == "available_now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.stream.interval_seconds} seconds")
    query = writer.start()
    log.info("streaming query %s (id %s) started, checkpoint %s", config.pipeline, query.id,
             checkpoint_location(config))
    return query


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
