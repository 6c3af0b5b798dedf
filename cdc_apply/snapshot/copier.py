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
- With the change log on, a copy's rows go into it too, each wave's or chunk's commit of them
  before the target's, after a Truncate row (``changelog/log_files.py``); the log records whether it
  holds them all (``ChangeLog.record_copy``): not for a resumed copy, whose rows are merged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.apply.session_kind import default_parallelism
from cdc_apply.apply.batch import BatchApplier
from cdc_apply.apply.evolve import apply_actions
from cdc_apply.apply.files import WrittenFile
from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS, DELETED
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.delta_internal import FileAppend
from cdc_apply.apply.targets import Target, quote
from cdc_apply.transactions import Transaction
from cdc_apply.changelog.log import ChangeLog
from cdc_apply.changerows.columns import inserted_images
from cdc_apply.config import SnapshotConfig, SourceConfig
from cdc_apply.failpoints import failpoint
from cdc_apply.lake.state import ResyncMarks
from cdc_apply.lsn import datetime_to_pg_us, format_lsn, parse_lsn, pg_us_to_datetime
from cdc_apply.progress import progress
from cdc_apply.sink import TableSnapshot
from cdc_apply.pgoutput import messages as m
from cdc_apply.sources.catalog import register_column_types
from cdc_apply.sources.slot import confirmed_flush
from cdc_apply.sources.copy_text import CopyRows
from cdc_apply.sources.exported_snapshot import CopyRange, ExportedSnapshot, PublishedTable, published_tables
from cdc_apply.changelog.log_files import MAX_SEQ, CopyLog
from cdc_apply.snapshot.pgcopy import CopyNeedsDriver, TableCopy, copy_frame, task_errors

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)



class Snapshotter:
    def __init__(self, source: SourceConfig, settings: SnapshotConfig, applier: BatchApplier,
                 changelog: ChangeLog | None) -> None:
        """Copies the tables of ``source``'s publications as ``settings`` say, committing through
        ``applier``; ``changelog``, when on, is told of each copy (its rows are not in the stream)."""
        self.source = source
        self.settings = settings
        self.applier = applier
        self.changelog = changelog
        self.resyncs = ResyncMarks(applier.options.state)

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
        if not self.settings.enabled and not forced:
            return []
        wanted = set(only_oids) if only_oids is not None else None
        conninfo = self.source.conninfo()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            tables = [t for t in published_tables(conn, self.source.publications)
                      if (wanted is None or t.relation.oid in wanted) and self.needs_copy(t)]
            estimates = {oid: int(n) for oid, n in conn.execute(
                "SELECT oid, greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = ANY(%s)",
                ([t.relation.oid for t in tables],)).fetchall()}
            # The types the stream's Type messages would name, so a target made by the copy has the
            # stream's column types (docs/types.md).
            register_column_types(conn, self.applier.schema.types,
                                  (c.type_oid for t in tables for c in t.relation.columns))
        if not tables:
            return []
        with ExportedSnapshot(conninfo) as snapshot:
            in_snapshot = {t.relation.oid: t for t in snapshot.published_tables(self.source.publications)}
            tables = [in_snapshot[t.relation.oid] for t in tables if t.relation.oid in in_snapshot]
            log.info("initial snapshot of %d table(s) at consistent point %s", len(tables),
                     format_lsn(snapshot.consistent_lsn))
            # One commit time for every table of a snapshot, as for the tables of one transaction: the
            # copies share its version too, and the change log holds them as one transaction.
            taken = datetime_to_pg_us(datetime.now(timezone.utc))
            return [self._copy(snapshot, table, estimates.get(table.relation.oid), taken) for table in tables]

    def _slot_confirmed(self) -> int:
        with psycopg.connect(self.source.conninfo(), autocommit=True) as conn:
            return confirmed_flush(conn, self.source.slot)

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

    def _copy(self, snapshot: ExportedSnapshot, table: PublishedTable, estimate: int | None,
              commit_ts: int) -> TableSnapshot:
        started = time.perf_counter()
        relation = table.relation
        target, existed = self.applier.ensure_target(relation, (snapshot.consistent_lsn - 1, 0))
        key = self._unique_key(table)
        sources, pages = snapshot.storage(table)
        on_executors = self._on_executors(relation, pages)
        layout = {"method": "ranges", "sources": sources} if on_executors else {"method": "key order"}
        resumed = _copy_progress(target, key, relation, layout) if existed else None
        if resumed is not None and self._slot_confirmed() > parse_lsn(resumed["since_lsn"]):  # type: ignore[arg-type]
            resumed = None  # the slot no longer holds the changes since the first rows: copy again
        if existed and resumed is None:
            target = self._emptied(target, relation, snapshot.consistent_lsn - 1)
        # A resumed copy's rows carry the first snapshot's point too, the version the table gets: a
        # row changed since is merged again from the stream with its own LSN, and the others' last
        # change came before that first snapshot.
        since = parse_lsn(resumed["since_lsn"]) if resumed else snapshot.consistent_lsn  # type: ignore[arg-type]
        progress = {"since_lsn": format_lsn(since), "consistent_lsn": format_lsn(snapshot.consistent_lsn),
                    "key": list(key), "columns": _column_signature(relation), **layout}
        copy = _TableCopyRun(table, target, since, progress, resumed, commit_ts)
        if self.changelog is not None:
            self.changelog.record_copy(relation.oid, table.qualified_name, since, None)
        if on_executors:
            try:
                rows = self._copy_ranges(snapshot, copy, estimate)
            except CopyNeedsDriver as exc:
                log.warning("%s: copied by the driver instead of Spark's tasks (%s)", table.qualified_name, exc)
                target = self._emptied(target, relation, snapshot.consistent_lsn - 1)
                since = snapshot.consistent_lsn
                progress.update(since_lsn=format_lsn(since), method="key order")
                progress.pop("sources", None)
                copy = _TableCopyRun(table, target, since, progress, None, copy.commit_ts)
                rows = self._copy_in_key_order(snapshot, copy, estimate)  # logged anew, after a new Truncate row
        else:
            rows = self._copy_in_key_order(snapshot, copy, estimate)
        if since != snapshot.consistent_lsn:  # resumed: rows of two snapshots; merge up to the newer one
            state = target.source_state()
            if state is not None:
                state.merge_until = snapshot.consistent_lsn
                apply_actions(target, [], state, format_lsn(snapshot.consistent_lsn))
        target.record_version(self.applier.app_id(relation.oid), since - 1, json.dumps(
            {"cdc_apply": "snapshot complete", "rows": rows, "consistent_lsn": format_lsn(since)}))
        if self.changelog is not None:
            self.changelog.record_copy(relation.oid, table.qualified_name, since, rows, logged=copy.log is not None)
        self.resyncs.remove(relation.oid)
        seconds = time.perf_counter() - started
        method = str(copy.progress["method"])
        log.info("snapshot of %s: %d rows in %.1f s (%s)", table.qualified_name, rows, seconds,
                 "Spark's tasks, page ranges" if method == "ranges" else "the driver, key order")
        return TableSnapshot(table.qualified_name, rows, snapshot.consistent_lsn, seconds, method)

    def _on_executors(self, relation: m.Relation, pages: int) -> bool:
        """Spark's tasks copy the table unless the config says the driver does, the table is one
        range (``snapshot.range_pages``) or less, which one task would read while the job's
        planning costs more than the copy, or the target keeps versions (SCD type 2), whose rows
        the history collapse writes."""
        options = self.applier.options.for_table(relation.namespace, relation.name)
        return self.settings.method == "spark" and pages > self.settings.range_pages and options.scd_type != 2

    def _emptied(self, target: Target, relation: m.Relation, version: int) -> Target:
        """The target without the rows of a copy that cannot be resumed: for a resync, replaced by
        an empty one of today's schema; otherwise cleared."""
        if self.resyncs.pending(relation.oid):
            return self.applier.recreate_target(relation, (version, 0))
        target.clear()
        return target

    def _copy_in_key_order(self, snapshot: ExportedSnapshot, copy: _TableCopyRun, estimate: int | None) -> int:
        """The driver's copy: one COPY stream, ``chunk_rows`` at a time, each chunk its own commit,
        in key order when the table has a unique key (a copy cut short resumes after the last key)."""
        table, relation, key = copy.table, copy.table.relation, tuple(copy.progress["key"])  # type: ignore[arg-type]
        after: list[str] | None = copy.resumed["after"] if copy.resumed else None  # type: ignore[assignment]
        rows = int(copy.resumed["rows"]) if copy.resumed else 0  # type: ignore[arg-type]
        if copy.resumed:
            log.info("resuming the copy of %s after key %s (%d rows copied)", table.qualified_name, after, rows)
        positions = [[c.name for c in relation.columns].index(k) for k in key]
        self._start_log(copy, 1)
        with progress(f"snapshot {table.qualified_name}", estimate) as advance:
            for chunk in snapshot.rows(table, self.settings.chunk_rows, key, after):
                first_row = rows
                rows += len(chunk)
                after = [chunk.text(len(chunk) - 1, i) or "" for i in positions]  # a unique key's values are not null
                self._log_chunk(copy, chunk, first_row)
                self.applier.write_snapshot_chunk(
                    relation, inserted_images(chunk.buf, chunk.is_null, chunk.starts, chunk.lengths), first_row,
                    copy.since - 1, copy.commit_ts, {**copy.progress, "after": after, "rows": rows} if key else None)
                advance(len(chunk))
                failpoint("snapshot_chunk")
        return rows

    def _logs(self, copy: _TableCopyRun) -> bool:
        """With the change log on, the copy's rows go into it too (``changelog/log_files.py``), unless the
        copy resumes one cut short (rows of two snapshots, merged: it stays out of the log)."""
        return self.changelog is not None and copy.resumed is None

    def _start_log(self, copy: _TableCopyRun, seqs: int) -> None:
        if self.changelog is not None and self._logs(copy):
            copy.log = self.changelog.copy_log(copy.table.relation, copy.since - 1, copy.commit_ts, seqs)

    def _log_chunk(self, copy: _TableCopyRun, chunk: CopyRows, first_row: int) -> None:
        """A driver's chunk (the copy's ``first_row`` on) into the change log, in its own commit, before
        the target's; past the seqs a copy can number, the copy's logging stops."""
        if copy.log is None or self.changelog is None:
            return
        count = len(chunk)
        first_seq = copy.log.first_seq + 1 + first_row
        if first_seq + count > MAX_SEQ + 1:
            log.warning("%s: the copy's rows from row %d on are not written to the change log (past the int32 seq "
                        "column); a rebuild of this table from the log is refused", copy.table.qualified_name,
                        first_row + 1)
            copy.log = None
            return
        rows = copy.log.inserts(chunk.columns(), count, first_seq)
        if copy.log.by_writer:
            self.changelog.append_copy(copy.log, [rows])
        elif (written := copy.log.write([rows])) is not None:
            self.changelog.commit_copy([written], copy.table.relation, copy.since - 1)

    def _copy_ranges(self, snapshot: ExportedSnapshot, copy: _TableCopyRun, estimate: int | None) -> int:
        """Spark's tasks copy the table's page ranges (``snapshot/pgcopy.py``), ``ranges_per_commit`` per
        Delta commit, in page order; each commit records the range it ended at. A resumed copy (a
        table with a unique key) reads the ranges left from a new snapshot and merges them by key: a
        row that moved pages between the two snapshots may be in the rows copied already."""
        settings = self.settings
        table, target = copy.table, copy.target
        after = copy.resumed["after"] if copy.resumed else None
        _, ranges = snapshot.page_ranges(table, settings.range_pages, tuple(after) if after else None)  # type: ignore[arg-type]
        rows = target.read().count() if copy.resumed else 0
        if copy.resumed:
            log.info("resuming the copy of %s after range %s (%d rows copied)", table.qualified_name, after, rows)
        state = target.source_state()
        assert state is not None  # ensure_target made it
        spark = self.applier.spark
        tasks = min(settings.parallelism or default_parallelism(spark), settings.max_connections)
        schema = self.applier.schema
        job = TableCopy(self.source.conninfo(), snapshot.name, table, state.column_map(), target.data_types(),
                        schema.exact_text_columns(table.relation, state), dict(schema.types.named), settings.chunk_rows,
                        self._metadata_values(copy, table.relation))
        if self._logs(copy):
            # A range holds at most range_pages pages of the snapshot's rows (page_ranges): its seqs.
            slots = settings.range_pages * snapshot.tuples_per_page()
            self._start_log(copy, 1 + len(ranges) * slots)
            if copy.log is not None:
                copy.log = replace(copy.log, range_slots=slots, range_seqs={
                    (pages.source, pages.first_page): copy.log.first_seq + 1 + index * slots
                    for index, pages in enumerate(ranges)})
        with progress(f"snapshot {table.qualified_name}", estimate) as advance:
            for first in range(0, len(ranges), settings.ranges_per_commit):
                wave = ranges[first:first + settings.ranges_per_commit]
                metadata = json.dumps({"cdc_apply": "snapshot", "pipeline": self.applier.options.pipeline,
                                       "relation_oid": table.relation.oid, "source": table.qualified_name,
                                       "copy": {**copy.progress, "after": [wave[-1].source, wave[-1].end_page]}},
                                      sort_keys=True)
                # A resumed copy merges by key; any other writes its files in the tasks where it can.
                files = None if copy.resumed or settings.file_writer == "delta" else \
                    target.open_file_append(storage=self.applier.options.storage)
                # Where the target's or the log's rows go in through Delta's writer (Spark Connect, a
                # target by name, `file_writer: delta`), the log's are a frame of their own: its
                # tasks read the wave's ranges again, and it is committed first, as the files are.
                log_by_frame = copy.log is not None and (files is None or copy.log.by_writer)
                with task_errors(table.qualified_name):
                    if log_by_frame:
                        assert self.changelog is not None and copy.log is not None
                        self.changelog.append_copy_frame(
                            copy.log, copy_frame(spark, replace(job, log=copy.log, log_rows=True), wave, tasks))
                    if files is None:
                        written = self._write_copied(target, copy_frame(spark, job, wave, tasks), metadata,
                                                     state.keys if copy.resumed else ())
                    else:
                        written = self._commit_files(files, spark, replace(
                            job, files_root=target.file_root(self.applier.options.storage),
                            physical_columns=files.physical_columns, log=None if log_by_frame else copy.log),
                            wave, tasks, metadata)
                rows += written
                advance(written)
                failpoint("snapshot_chunk")
        return rows

    def _metadata_values(self, copy: _TableCopyRun, relation: m.Relation) -> dict[str, tuple[str, object]]:
        """The metadata columns a snapshot chunk's rows get: the copy's version as their commit LSN,
        its start as their commit time, and not deleted."""
        values: dict[str, tuple[str, object]] = {COMMIT_LSN: ("bigint", copy.since - 1),
                                                 COMMIT_TS: ("timestamp", pg_us_to_datetime(copy.commit_ts))}
        if self.applier.options.for_table(relation.namespace, relation.name).delete_mode == "soft":
            values[DELETED] = ("boolean", False)
        return values

    def _commit_files(self, files: FileAppend, spark: SparkSession, job: TableCopy, wave: Sequence[CopyRange],
                      tasks: int, metadata: str) -> int:
        """One commit of the files the tasks wrote for ``wave`` into the target, after one of those they
        wrote into the change log (``job.log``); returns the rows the target's hold. A failed task's
        files, and a wave's files when the run dies before their commit, are in no commit (VACUUM
        removes them)."""
        rows = copy_frame(spark, job, wave, tasks).collect()
        logged = [WrittenFile(row.path, row.size, row.rows, row.stats, {"relation_oid": str(job.table.relation.oid)})
                  for row in rows if row.changelog]
        if logged and self.changelog is not None and job.log is not None:
            self.changelog.commit_copy(logged, job.table.relation, job.log.version)
        written = [WrittenFile(row.path, row.size, row.rows, row.stats) for row in rows if not row.changelog]
        files.commit(written, metadata)
        return sum(file.rows for file in written)

    @staticmethod
    def _write_copied(target: Target, frame: DataFrame, metadata: str, merge_keys: tuple[str, ...]) -> int:
        """One commit of copied rows: appended, or merged by ``merge_keys`` (a resumed copy's rows);
        returns how many rows it wrote (from the commit's metrics)."""
        commit = DataCommit(None, 0, metadata)
        if merge_keys:
            condition = " AND ".join(f"t.{quote(k)} <=> s.{quote(k)}" for k in merge_keys)
            with commit.checked(target.spark):
                target.merge(frame, condition).when_matched_update_all().when_not_matched_insert_all().execute()
        else:
            target.write(frame, "append", **commit.write_options())
        metrics = target.last_commit().operationMetrics or {}
        if merge_keys:
            return int(metrics.get("numTargetRowsInserted", 0)) + int(metrics.get("numTargetRowsUpdated", 0))
        return int(metrics.get("numOutputRows", 0))


@dataclass
class _TableCopyRun:
    """One table's copy in this run: where it goes, the version its rows get (``since - 1``), the
    commit metadata every commit of it records (``progress``), and what an earlier run copied."""

    table: PublishedTable
    target: Target
    since: int
    progress: dict[str, object]
    resumed: dict[str, object] | None
    commit_ts: int
    log: CopyLog | None = None  # where its rows go in the change log; None: not there (not all of them)


def _copy_progress(target: Target, key: tuple[str, ...], relation: m.Relation,
                   layout: dict[str, object]) -> dict[str, object] | None:
    """Where a copy cut short got to: the ``"copy"`` metadata of the target's newest commit, which is
    the last chunk or range written, when the copy can go on (the same unique key, columns and
    layout: method, and storage relations for ranges); None to start over (no commit yet, a clear,
    another key, other columns, or partitions attached or detached since)."""
    if not key:
        return None
    newest = target.last_commit()
    try:
        metadata = json.loads((newest.userMetadata if newest is not None else None) or "{}")
    except ValueError:
        return None
    copied = metadata.get("copy") if metadata.get("cdc_apply") == "snapshot" else None
    if not copied or copied.get("key") != list(key) or copied.get("columns") != _column_signature(relation) \
            or any(copied.get(name) != value for name, value in layout.items()):
        return None
    return copied


def _column_signature(relation: m.Relation) -> list[list[object]]:
    """What a resumed copy must find unchanged: every column's name, type OID and typmod."""
    return [[c.name, c.type_oid, c.typmod] for c in relation.columns]
