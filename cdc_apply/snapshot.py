"""Initial snapshot: copy a published table as of an exported snapshot into its Delta target, then
record the snapshot's consistent point as the table's applied version.

Invariants:
- A target that holds a Delta transaction version for this pipeline's app id is in sync: every
  change committed before ``version + 1`` is in it, and ``BatchApplier`` skips streamed rows at or
  below that version. The snapshot records ``consistent point - 1``: transactions committing
  before the consistent point are in the copy, those at or after it come from the slot.
- The version is recorded last, in its own commit. A copy cut short (crash, error) leaves a target
  without a version. A table with its own unique key (replica identity DEFAULT with a primary key,
  or USING INDEX) is copied in key order and each chunk's commit records how far it got
  (``"copy"`` in its userMetadata: the key after which the next chunk starts, and ``since_lsn``, the
  consistent point of the oldest snapshot the target holds rows of). The next run resumes after
  that key from a new snapshot, records ``since_lsn - 1`` as the version, so the slot replays every
  change since the oldest rows, and sets ``merge_until`` to the new consistent point: up to it,
  new rows are merged, never appended, because the newer rows already hold those changes. Other
  tables, or a table whose columns changed in between, are cleared and copied again.
- The slot the pipeline reads was created before the snapshot (its position is at or before the
  consistent point), so nothing committed after the copy is lost. This also holds for a table
  added to the publication later: its first streamed changes trigger its own snapshot, and the
  changes that the copy already holds are skipped by the version.
- A resync (``resync``) first leaves a mark (``<warehouse>/_cdc_apply/resync/<pipeline>/<oid>``),
  then replaces the target with an empty one of today's schema, copies, records the new version,
  and removes the mark last. While the mark exists the target counts as not in sync, so a resync
  cut short is finished by the next ``resync`` or run, which resumes it like any copy; the old
  version never vouches for a half-copied table.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psycopg

from cdc_apply.apply.batch import BatchApplier
from cdc_apply.apply.evolve import apply_actions
from cdc_apply.apply.targets import Target
from cdc_apply.assemble import Transaction
from cdc_apply.changerows.columns import inserted_images
from cdc_apply.config import Config
from cdc_apply.failpoints import failpoint
from cdc_apply.lsn import datetime_to_pg_us, format_lsn, parse_lsn
from cdc_apply.progress import progress
from cdc_apply.pgoutput import messages as m
from cdc_apply.sources.slot import confirmed_flush
from cdc_apply.sources.snapshot import ExportedSnapshot, PublishedTable, published_tables

log = logging.getLogger(__name__)


@dataclass
class TableSnapshot:
    table: str
    rows: int
    consistent_lsn: int
    seconds: float


class ResyncMarks:
    """Tables whose re-copy was asked for and has not finished: one empty file per relation OID."""

    def __init__(self, warehouse: str, pipeline: str) -> None:
        self.directory = Path(warehouse) / "_cdc_apply" / "resync" / pipeline

    def _path(self, oid: int) -> Path:
        return self.directory / str(oid)

    def add(self, oid: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._path(oid), "w") as handle:
            os.fsync(handle.fileno())

    def pending(self, oid: int) -> bool:
        return self._path(oid).exists()

    def remove(self, oid: int) -> None:
        self._path(oid).unlink(missing_ok=True)


class Snapshotter:
    def __init__(self, config: Config, applier: BatchApplier) -> None:
        self.config = config
        self.applier = applier
        self.resyncs = ResyncMarks(applier.options.warehouse, config.pipeline)

    def needs_copy(self, table: PublishedTable) -> bool:
        relation = table.relation
        options = self.applier.options.for_table(relation.namespace, relation.name)
        if not options.include:
            return False
        if self.resyncs.pending(relation.oid):
            return True
        target, _ = self.applier.target(relation, options)
        return not target.exists() or target.committed_version(self.applier.app_id(relation.oid)) is None

    def resync(self, oids: Iterable[int]) -> list[TableSnapshot]:
        """Copy these tables again from a new snapshot, whatever their targets hold."""
        oids = list(oids)
        for oid in oids:
            self.resyncs.add(oid)
        return self.sync(oids, forced=True)

    def sync(self, only_oids: Iterable[int] | None = None, forced: bool = False) -> list[TableSnapshot]:
        """Copy every published table (or those of ``only_oids``) whose target is not in sync.
        ``forced``: also when ``snapshot.enabled`` is false (a resync asked for by name)."""
        if not self.config.snapshot.enabled and not forced:
            return []
        wanted = set(only_oids) if only_oids is not None else None
        conninfo = self.config.source.conninfo()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            tables = [t for t in published_tables(conn, self.config.source.publications)
                      if (wanted is None or t.relation.oid in wanted) and self.needs_copy(t)]
            estimates = {oid: int(n) for oid, n in conn.execute(
                "SELECT oid, greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = ANY(%s)",
                ([t.relation.oid for t in tables],)).fetchall()}
        if not tables:
            return []
        with ExportedSnapshot(conninfo) as snapshot:
            in_snapshot = {t.relation.oid: t for t in snapshot.published_tables(self.config.source.publications)}
            tables = [in_snapshot[t.relation.oid] for t in tables if t.relation.oid in in_snapshot]
            log.info("initial snapshot of %d table(s) at consistent point %s", len(tables),
                     format_lsn(snapshot.consistent_lsn))
            return [self._copy(snapshot, table, estimates.get(table.relation.oid)) for table in tables]

    def _slot_confirmed(self) -> int:
        with psycopg.connect(self.config.source.conninfo(), autocommit=True) as conn:
            return confirmed_flush(conn, self.config.source.slot)

    def _unique_key(self, table: PublishedTable) -> tuple[str, ...]:
        """The source's own unique key, in which order a copy can resume; () for any other table."""
        relation = table.relation
        if self.applier.options.for_table(relation.namespace, relation.name).keys:
            return ()  # configured keys need not be unique
        return tuple(relation.key_columns) if relation.replica_identity in ("d", "i") else ()

    def sync_new(self, transactions: Iterable[Transaction]) -> list[TableSnapshot]:
        """Before a batch: copy the tables it touches that have no target yet (added to the publication)."""
        unknown = set().union(*(t.relation_oids() for t in transactions)) - set(self.applier.registry.entries())
        return self.sync(unknown) if unknown else []

    def _copy(self, snapshot: ExportedSnapshot, table: PublishedTable, estimate: int | None) -> TableSnapshot:
        started = time.perf_counter()
        relation = table.relation
        chunk_version = snapshot.consistent_lsn - 1
        target, existed = self.applier.ensure_target(relation, (chunk_version, 0))
        key = self._unique_key(table)
        resumed = _copy_progress(target, key, relation) if existed else None
        if resumed is not None and self._slot_confirmed() > parse_lsn(resumed["since_lsn"]):  # type: ignore[arg-type]
            resumed = None  # the slot no longer holds the changes since the first rows: copy again
        if existed and resumed is None and self.resyncs.pending(relation.oid):
            target = self.applier.recreate_target(relation, (chunk_version, 0))  # today's schema, no rows
        elif existed and resumed is None:
            target.clear()  # a copy that was cut short, and cannot be resumed
        since = parse_lsn(resumed["since_lsn"]) if resumed else snapshot.consistent_lsn
        # A resumed copy's rows carry the first snapshot's point too, the version the table gets: a
        # row changed since is merged again from the stream with its own LSN, and the others' last
        # change came before that first snapshot.
        chunk_version = since - 1
        after: list[str] | None = resumed["after"] if resumed else None
        rows = int(resumed["rows"]) if resumed else 0
        if resumed:
            log.info("resuming the copy of %s after key %s (%d rows copied)", table.qualified_name, after, rows)
        commit_ts = datetime_to_pg_us(datetime.now(timezone.utc))
        positions = [[c.name for c in relation.columns].index(k) for k in key]
        with progress(f"snapshot {table.qualified_name}", estimate) as advance:
            for chunk in snapshot.rows(table, self.config.snapshot.chunk_rows, key, after):
                first_row = rows
                rows += len(chunk)
                after = [chunk.text(len(chunk) - 1, i) or "" for i in positions]  # a unique key's values are not null
                copied = {"since_lsn": format_lsn(since), "consistent_lsn": format_lsn(snapshot.consistent_lsn),
                          "key": list(key), "after": after, "rows": rows, "columns": _column_signature(relation)}
                self.applier.write_snapshot_chunk(
                    relation, inserted_images(chunk.buf, chunk.is_null, chunk.starts, chunk.lengths), first_row,
                    chunk_version, commit_ts, copied if key else None)
                advance(len(chunk))
                failpoint("snapshot_chunk")
        if since != snapshot.consistent_lsn:  # resumed: rows of two snapshots; merge up to the newer one
            state = target.source_state()
            if state is not None:
                state.merge_until = snapshot.consistent_lsn
                apply_actions(target, [], state, format_lsn(snapshot.consistent_lsn))
        version = since - 1
        target.record_version(self.applier.app_id(relation.oid), version, json.dumps(
            {"cdc_apply": "snapshot complete", "rows": rows, "consistent_lsn": format_lsn(since)}))
        self.resyncs.remove(relation.oid)
        seconds = time.perf_counter() - started
        log.info("snapshot of %s: %d rows in %.1f s", table.qualified_name, rows, seconds)
        return TableSnapshot(table.qualified_name, rows, snapshot.consistent_lsn, seconds)


def _copy_progress(target: Target, key: tuple[str, ...], relation: m.Relation) -> dict[str, object] | None:
    """Where a copy cut short got to: the ``"copy"`` metadata of the target's newest commit, which is
    the last chunk written, when the copy can go on (the same unique key and columns as now); None
    to start over (no chunk yet, a clear, another key or other columns)."""
    if not key:
        return None
    newest = target.delta().history(1).select("userMetadata").collect()
    try:
        metadata = json.loads((newest[0].userMetadata if newest else None) or "{}")
    except ValueError:
        return None
    copied = metadata.get("copy") if metadata.get("cdc_apply") == "snapshot" else None
    if not copied or copied.get("key") != list(key) or copied.get("columns") != _column_signature(relation):
        return None
    return copied


def _column_signature(relation: m.Relation) -> list[list[object]]:
    """What a resumed copy must find unchanged: every column's name, type OID and typmod."""
    return [[c.name, c.type_oid, c.typmod] for c in relation.columns]
