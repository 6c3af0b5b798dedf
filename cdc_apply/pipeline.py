"""SQL-interface batch mode (`run --once`) and `capture`: peek the slot, drive the replication core
(``cdc_apply.replication``, which holds the invariants), advance the slot. The walsender loop for
`run --follow` is `cdc_apply.live`.

Each round peeks at most ``batching.max_changes`` messages from the slot (whole transactions, up to
the WAL position the run started at) into a new core, which applies the committed transactions and
then advances the slot. A crash between apply and advance re-reads the same transactions next
time; the targets' Delta transaction versions make the second apply a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.apply.delta_log import writer_versions
from cdc_apply.apply.options import apply_options
from cdc_apply.lake.state import TargetRegistry
from cdc_apply.transactions import Transaction
from cdc_apply.config import Config
from cdc_apply.failpoints import failpoint
from cdc_apply.lsn import format_lsn
from cdc_apply.parts import run_parts
from cdc_apply.replication import ReplicationCore
from cdc_apply.runtime import StopFlag
from cdc_apply.sink import RunSummary
from cdc_apply.sources.catalog import SourceCatalog, read_type_facts
from cdc_apply.sources.health import HealthMonitor
from cdc_apply.sources.preflight import PreflightError, check_source, ensure_publication_and_slot, protocol_options
from cdc_apply.sources.slot import (
    SLOT_GONE, PgOutputOptions, advance_slot, confirmed_flush, current_wal_lsn, read_changes, server_version_num,
    slot_exists,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def _has_configured_keys(config: Config) -> Callable[[str, str], bool]:
    options = apply_options(config)
    return lambda schema, table: bool(options.for_table(schema, table).keys)


def _prepare(conn: psycopg.Connection, config: Config, health: HealthMonitor | None = None,
             new_slot: bool = False) -> PgOutputOptions:
    """Check the source, create what the config asks for, check the slot's health (with the runner's
    own monitor when it keeps one, so its metrics see this first check), and choose the protocol options.
    ``new_slot``: a missing slot may be created though the targets hold changes (``resync --all``)."""
    check_source(conn, config.source, _has_configured_keys(config), copies=config.snapshot.enabled)
    if not new_slot:
        _refuse_a_slot_that_would_skip_changes(conn, config)
    ensure_publication_and_slot(conn, config.source)
    (health or HealthMonitor(config.source)).check(conn, starting=True)
    return protocol_options(config.source, server_version_num(conn))


def prepare_source(config: Config, health: HealthMonitor | None = None, *, new_slot: bool = False) -> PgOutputOptions:
    with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
        return _prepare(conn, config, health, new_slot)


def _refuse_a_slot_that_would_skip_changes(conn: psycopg.Connection, config: Config) -> None:
    """A missing slot is created only for a pipeline whose targets hold none of its changes yet: a new
    slot starts now, so every change since what the targets hold would be lost without a word (a
    failover to a server without a synced copy of the slot, a dropped slot). Catalog targets
    (``tables.<t>.name``) are not read here."""
    source = config.source
    if slot_exists(conn, source.slot):
        return
    state = apply_options(config).state
    for oid, entry in sorted(TargetRegistry(state).entries().items()):
        writer = None if entry["by_name"] else writer_versions(entry["location"], state.storage).get(
            f"{config.pipeline}/{oid}")
        if writer is not None:
            raise PreflightError(
                f"replication slot {source.slot!r} does not exist on {source.describe()}, but this pipeline's targets "
                f"hold its changes ({entry['schema']}.{entry['table']} up to LSN {format_lsn(writer.version)}): "
                + SLOT_GONE)


def _slot_advancer(conn: psycopg.Connection, config: Config, summary: RunSummary | None = None) -> Callable[[int], None]:
    slot = config.source.slot

    def advance(lsn: int) -> None:
        advance_slot(conn, slot, lsn)
        if summary is not None:
            summary.confirmed_lsn = lsn
        log.info("confirmed slot %s to %s", slot, format_lsn(lsn))

    return advance


def drain(config: Config, spark: SparkSession, *, stop: StopFlag | None = None) -> RunSummary:
    """Apply everything the slot holds up to the current WAL position, then return."""
    summary = RunSummary()
    source = config.source
    with psycopg.connect(source.conninfo(), autocommit=True) as conn:
        options = _prepare(conn, config)
        upto = current_wal_lsn(conn)
        # confirm_after: changelog: the batches only go to the log; the targets follow at the end (in_process),
        # or cdc-apply follow-changelog brings them up (separate).
        parts = run_parts(config, spark, summary, follower=False)
        summary.snapshots += parts.snapshotter.sync()
        advance = _slot_advancer(conn, config, summary)
        log.info("reading slot %s of %s up to %s", source.slot, source.describe(), format_lsn(upto))
        limit = config.batching.max_changes
        while stop is None or not stop.event.is_set():
            summary.rounds += 1
            with ReplicationCore(parts.sink, advance, confirmed=confirmed_flush(conn, source.slot),
                                 spill_bytes=config.batching.spill_bytes, skip_origins=source.skip_origins,
                                 type_facts=SourceCatalog(source.conninfo()).type_facts) as core:
                raws = list(read_changes(conn, source.slot, options, upto_lsn=upto, upto_nchanges=limit))
                if not raws:
                    core.advance_idle(upto)  # nothing published up to the start position: the rest is others' WAL
                    break
                failpoint("after_receive")
                core.feed(raws)
                if not core.flush():
                    if len(raws) >= limit:
                        limit *= 2  # one transaction is larger than the window: widen it and read again
                        continue
                    break  # only undecided (prepared or open streamed) transactions are left
            limit = config.batching.max_changes
    if parts.from_log is not None:
        parts.from_log.catch_up()
    return summary


class _CaptureWritten:
    """The sink of ``capture --consume``: the capture file, already written and closed in full."""

    def write_batch(self, batch: list[Transaction]) -> None:
        pass


def capture(config: Config, out: str, *, consume: bool = False) -> tuple[int, str]:
    """Write what the slot holds (up to the current WAL position) to a capture file, plus manifest.json.

    Returns (messages written, manifest path). The slot is advanced only with ``consume``.
    """
    import json
    from pathlib import Path

    from cdc_apply.sources.capture import PARQUET_SUFFIXES, with_type_facts, write_jsonl, write_parquet

    source = config.source
    with psycopg.connect(source.conninfo(), autocommit=True) as conn:
        options = _prepare(conn, config)
        version = server_version_num(conn)
        raws = list(with_type_facts(read_changes(conn, source.slot, options, upto_lsn=current_wal_lsn(conn)),
                                    lambda oid: read_type_facts(conn, oid)))
        path = Path(out)
        writer = write_parquet if path.suffix.lower() in PARQUET_SUFFIXES else write_jsonl
        count = writer(path, raws)
        manifest = path.with_name("manifest.json")
        manifest.write_text(json.dumps({
            "file": path.name, "messages": count, "server_version_num": version, "slot": source.slot,
            "options": dict(options.as_pairs()), "first_lsn": format_lsn(raws[0].lsn) if raws else None,
            "last_lsn": format_lsn(raws[-1].lsn) if raws else None}, indent=1))
        if consume and raws:
            with ReplicationCore(_CaptureWritten(), _slot_advancer(conn, config),
                                 confirmed=confirmed_flush(conn, source.slot), skip_origins=source.skip_origins) as core:
                core.feed(raws)
                core.flush()
    return count, str(manifest)
