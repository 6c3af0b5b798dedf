"""`cdc-apply resync`: copy some tables again from a new exported snapshot; the slot keeps its position.

The copy is the initial snapshot's (``Snapshotter``), with its exactly-once version: the target
records ``new consistent point - 1``, so when the pipeline runs again it skips the slot's changes
of that table the copy already holds and applies the later ones; other tables are untouched.

The pipeline must not be running: the slot's health check refuses a slot another process reads,
since two writers would race on the target. Uses: a table that must change a column's type
without a widening, a target damaged by hand, and after an invalidated slot (drop it, then
``resync --all``: the new slot is created before the copies, so nothing between is lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.config import Config, ConfigError
from cdc_apply.parts import copier
from cdc_apply.pipeline import prepare_source
from cdc_apply.sink import TableSnapshot
from cdc_apply.sources.health import publication_tables

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def published_oids(config: Config, tables: Sequence[str] | None) -> list[int]:
    """The relation OIDs of ``tables`` (``schema.table``; None: every published table). Checks the
    source and creates the slot first when it is missing (after an invalidated one was dropped)."""
    prepare_source(config, new_slot=tables is None)  # only a copy of every table makes up for a new slot
    with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
        published = {name: oid for oid, name in (publication_tables(conn, config.source.publications) or {}).items()}
    names = list(published) if tables is None else list(dict.fromkeys(tables))
    unknown = [name for name in names if name not in published]
    if unknown:
        raise ConfigError(f"--table: {', '.join(unknown)} not in {config.source.describe_publications()} "
                          f"(it has: {', '.join(sorted(published)) or 'no tables'})")
    return [published[name] for name in names]


def resync(config: Config, spark: SparkSession, oids: Sequence[int]) -> list[TableSnapshot]:
    """Re-copy the tables of ``oids`` (from ``published_oids``)."""
    return copier(config, spark).resync(oids)
