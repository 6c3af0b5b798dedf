"""Initial snapshot: copy a published table as of an exported snapshot into its Delta target, then
record the snapshot's consistent point as the table's applied version.

Invariants:
- A target that holds a Delta transaction version for this pipeline's app id is in sync: every
  change committed before ``version + 1`` is in it, and ``BatchApplier`` skips streamed rows at or
  below that version. The snapshot records ``consistent point - 1``: transactions committing
  before the consistent point are in the copy, those at or after it come from the slot.
- The version is recorded last, in its own commit. A copy cut short (crash, error) leaves a target
  without a version; the next run clears it and copies again.
- The slot the pipeline reads was created before the snapshot (its position is at or before the
  consistent point), so nothing committed after the copy is lost. This also holds for a table
  added to the publication later: its first streamed changes trigger its own snapshot, and the
  changes that the copy already holds are skipped by the version.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

import psycopg

from cdc_apply.apply.batch import BatchApplier
from cdc_apply.assemble import Change, Transaction
from cdc_apply.config import Config
from cdc_apply.failpoints import failpoint
from cdc_apply.lsn import datetime_to_pg_us, format_lsn
from cdc_apply.progress import progress
from cdc_apply.sources.snapshot import ExportedSnapshot, PublishedTable, published_tables

log = logging.getLogger(__name__)


@dataclass
class TableSnapshot:
    table: str
    rows: int
    consistent_lsn: int
    seconds: float


class Snapshotter:
    def __init__(self, config: Config, applier: BatchApplier) -> None:
        self.config = config
        self.applier = applier

    def needs_copy(self, table: PublishedTable) -> bool:
        relation = table.relation
        options = self.applier.options.for_table(relation.namespace, relation.name)
        if not options.include:
            return False
        target, _ = self.applier.target(relation, options)
        return not target.exists() or target.committed_version(self.applier.app_id(relation.oid)) is None

    def sync(self, only_oids: Iterable[int] | None = None) -> list[TableSnapshot]:
        """Copy every published table (or those of ``only_oids``) whose target is not in sync."""
        if not self.config.snapshot.enabled:
            return []
        wanted = set(only_oids) if only_oids is not None else None
        conninfo = self.config.source.conninfo()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            tables = [t for t in published_tables(conn, self.config.source.publication)
                      if (wanted is None or t.relation.oid in wanted) and self.needs_copy(t)]
            estimates = {oid: int(n) for oid, n in conn.execute(
                "SELECT oid, greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = ANY(%s)",
                ([t.relation.oid for t in tables],)).fetchall()}
        if not tables:
            return []
        with ExportedSnapshot(conninfo) as snapshot:
            in_snapshot = {t.relation.oid: t for t in snapshot.published_tables(self.config.source.publication)}
            tables = [in_snapshot[t.relation.oid] for t in tables if t.relation.oid in in_snapshot]
            log.info("initial snapshot of %d table(s) at consistent point %s", len(tables),
                     format_lsn(snapshot.consistent_lsn))
            return [self._copy(snapshot, table, estimates.get(table.relation.oid)) for table in tables]

    def sync_new(self, transactions: Iterable[Transaction]) -> list[TableSnapshot]:
        """Before a batch: copy the tables it touches that have no target yet (added to the publication)."""
        unknown = {c.relation.oid for t in transactions for c in t.changes} - set(self.applier.registry.entries())
        return self.sync(unknown) if unknown else []

    def _copy(self, snapshot: ExportedSnapshot, table: PublishedTable, estimate: int | None) -> TableSnapshot:
        started = time.perf_counter()
        version = snapshot.consistent_lsn - 1
        target, existed = self.applier.ensure_target(table.relation, (version, 0))
        if existed:
            target.clear()  # a copy that was cut short
        commit_ts = datetime_to_pg_us(datetime.now(timezone.utc))
        rows = 0
        with progress(f"snapshot {table.qualified_name}", estimate) as advance:
            for chunk in snapshot.rows(table, self.config.snapshot.chunk_rows):
                changes = [Change(rows + i, "I", table.relation, new=image) for i, image in enumerate(chunk)]
                self.applier.apply([Transaction(0, version, version, commit_ts, changes, kind="snapshot")],
                                   snapshot=True)
                rows += len(chunk)
                advance(len(chunk))
                failpoint("snapshot_chunk")
        target.record_version(self.applier.app_id(table.relation.oid), version, json.dumps(
            {"cdc_apply": "snapshot complete", "rows": rows, "consistent_lsn": format_lsn(snapshot.consistent_lsn)}))
        seconds = time.perf_counter() - started
        log.info("snapshot of %s: %d rows in %.1f s", table.qualified_name, rows, seconds)
        return TableSnapshot(table.qualified_name, rows, snapshot.consistent_lsn, seconds)
