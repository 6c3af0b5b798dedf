"""The change log: every batch's change rows in one Delta table, beside the targets (docs/change-log-table.md).

The rows are the ``pgoutput`` data source's (``spark/rows.py``): the change-row columns, the
``key``/``old``/``new`` images as maps of PostgreSQL's text, ``_cdc_change`` (the change's message
bytes) and ``_cdc_relation`` (the Relation message in force), so that a replay
(``replay.replay_changelog``) decodes what the first apply decoded, and converts with whatever
type overrides it has then. The table is partitioned by ``relation_oid``: one table's changes
are read from its own files, and an LSN range is skipped over by the files' ``commit_lsn``
statistics. The driver writes the files itself with pyarrow (``apply/files.py``) and commits them
(``targets.FileAppend``); a log by catalog name or on object storage goes through Spark's writer.

Invariants:
- Exactly once: each batch is one commit with ``txnAppId = <pipeline>/changelog`` and
  ``txnVersion = the batch's last commit LSN``; the transactions of a batch at or below the version
  the table holds are not appended again (a batch read again after a crash, perhaps cut
  differently), so the log never holds a transaction twice.
- The log is written before the targets (``sink.DeltaSink``): whatever a target holds, the log
  holds too. The slot is confirmed after both (``confirm_after: targets``), or after the log's
  commit, the targets following from it (``confirm_after: changelog``, ``changelog/applier.py``).
- The table names the pipeline that writes it and its layout (``cdc_apply.changelog`` property);
  another pipeline's log, or another layout, is refused, never appended to.
- An initial copy's rows are in the log too, written by the copy's writers (``CopyLog``,
  ``commit_copy``) before the target's: ``xid`` 0, at the copy's version, after a Truncate row.
  Each copy is recorded (``record_copy``) before it starts and once its rows are all in the log; a
  rebuild that would lack them is refused (``refuse_if_copy_missing``).
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.apply.sessionconf import delta_write_options
from cdc_apply.apply.files import WrittenFile
from cdc_apply.apply.delta_internal import FileAppend, KnownVersionAppend
from cdc_apply.apply.staging import NO_STAGING, pipeline_staging, staging_scope
from cdc_apply.apply.targets import Target, sql_string
from cdc_apply.transactions import SpilledChanges, Transaction
from cdc_apply.config import Config
from cdc_apply.errors import CdcApplyError
from cdc_apply.lake.location import Location, Storage
from cdc_apply.lake.state import PipelineState
from cdc_apply.lsn import format_lsn, parse_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.changelog.log_files import COPY_XID, MAX_SEQ, CopyLog, write_log_file
from cdc_apply.spark.rows import SOURCE_SCHEMA, SPARK_DDL, record_batches

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

LAYOUT = 1  # the columns of spark/rows.py's untyped rows, partitioned by relation_oid
PROPERTY = "cdc_apply.changelog"
TRIMMED_PROPERTY = "cdc_apply.changelog.trimmed_through"  # set by ``trim``: rows up to this LSN are gone
# ``cdc_apply.changelog.copied.<relation oid>``: the table's last initial copy (or resync), whose rows
# went to the target only: {"table", "lsn" (the copy's consistent point), "rows" (null until it ends)}.
COPIED_PROPERTY = "cdc_apply.changelog.copied."
# A piece of a spilled transaction costs the driver many times its size while it becomes decoded
# changes, text images and Arrow. Driver peak and slot confirmed for a 1 GB transaction (``bench
# memory --megabytes 1024 --updates --changelog``), when each piece went through a Spark frame:
# 8 MiB 346 MB / 73 s, 4 MiB 310 MB / 92 s, 16 MiB (MAX_PIECE_BYTES) up to 462 MB; since the driver
# writes the pieces' files itself, 8 MiB 319 MB / 25 s.
LOG_PIECE_BYTES = 8 * 1024 * 1024

class ChangeLogError(CdcApplyError):
    """A change log this pipeline must not write or read as its own."""


@dataclass(frozen=True)
class RecordedCopy:
    """A table's last initial copy (or resync) as the log recorded it (``ChangeLog.record_copy``)."""

    table: str  # schema.table
    lsn: int  # the copy's consistent point
    rows: int | None  # None: not ended (or cut short)
    logged: bool = False  # its rows are in the log (``CopyLog``): a rebuild from the log holds them

    @property
    def version(self) -> int:
        """The version the copy leaves its target at."""
        return self.lsn - 1


def changelog_target(spark: SparkSession, config: Config, warehouse: str | None = None) -> Target:
    """Where the pipeline's change log is: ``changelog.name``, ``changelog.path``, or
    ``<warehouse>/_cdc_apply/changelog``."""
    settings = config.changelog
    storage = Storage.from_spark_conf(config.spark)
    if settings.name is not None:
        return Target(spark, settings.name, True, storage, config.target.delta_internals)
    state = PipelineState.at(warehouse or config.target.warehouse, config.pipeline, storage)
    path = settings.path or str(state.location("changelog"))
    # Staged under the warehouse when the log is there too: then Spark, which writes the log, reaches it.
    staging = pipeline_staging(state, config.target.staging_rows) \
        if Location.parse(path).is_strictly_under(state.warehouse) else NO_STAGING
    return Target(spark, path, False, storage, config.target.delta_internals, staging)


def enabled_changelog(spark: SparkSession, config: Config) -> ChangeLog | None:
    """The pipeline's change log when ``changelog.enabled``, else None."""
    return ChangeLog(spark, config) if config.changelog.enabled else None


class ChangeLog:
    def __init__(self, spark: SparkSession, config: Config, warehouse: str | None = None) -> None:
        self.spark = spark
        self.pipeline = config.pipeline
        self.app_id = f"{config.pipeline}/changelog"
        self.target = changelog_target(spark, config, warehouse)
        self.storage = self.target.storage  # the log's own files reach its store with it
        self._version: int | None = None
        self._ready = False
        self._fenced = False
        self.piece_bytes = min(LOG_PIECE_BYTES, config.batching.spill_bytes)
        self.pieces_written = 0  # pieces of spilled transactions in the last append
        self._layout_types: dict[str, Any] | None = None  # the layout's Spark types, by column

    def _identity(self) -> str:
        return json.dumps({"pipeline": self.pipeline, "layout": LAYOUT}, sort_keys=True)

    def ensure(self) -> None:
        """The table created (empty) when missing, else checked to be this pipeline's, in this layout."""
        if self._ready:
            return
        if not self.target.exists():
            self.spark.sql(f"CREATE TABLE IF NOT EXISTS {self.target.sql} ({SPARK_DDL}) USING delta "
                           f"PARTITIONED BY (relation_oid) TBLPROPERTIES ({sql_string(PROPERTY)} = "
                           f"{sql_string(self._identity())})")
            log.info("created the change log %s", self.target.location)
        self.check()
        self._version = self.target.committed_version(self.app_id)
        self._ready = True

    def _ensure_writing(self) -> None:
        """Before this process's first append: on Connect, the fence (``apply/fence.py``), so that a
        killed client's append cannot land after the version read that follows it. Only the log's
        writer fences its identity: a reader's fence (`follow-changelog`, `trim-changelog`, `status`)
        would fail the running writer's append as a concurrent transaction."""
        self.ensure()
        if not self._fenced:
            self.target.fence(self.app_id)
            self._version = self.target.committed_version(self.app_id)
            self._fenced = True

    def check(self) -> None:
        """Refuses a table that is not this pipeline's change log in this layout."""
        text = self.target.properties().get(PROPERTY)
        try:
            identity = json.loads(text) if text else None
        except ValueError:
            identity = None
        if not isinstance(identity, dict):
            raise ChangeLogError(f"{self.target.location} is not a cdc_apply change log (no {PROPERTY} property); "
                                 "set changelog.path or changelog.name to another table")
        if identity.get("pipeline") != self.pipeline:
            raise ChangeLogError(f"{self.target.location} is the change log of pipeline {identity.get('pipeline')!r}, "
                                 f"not {self.pipeline!r}: each pipeline writes its own (changelog.path or .name)")
        if identity.get("layout") != LAYOUT:
            raise ChangeLogError(f"{self.target.location} has change log layout {identity.get('layout')!r}; this "
                                 f"cdc_apply writes and reads layout {LAYOUT}: use the cdc_apply that wrote it, or "
                                 "start a new change log")

    @property
    def version(self) -> int | None:
        """The last commit LSN the log holds (None: nothing yet)."""
        self.ensure()
        return self._version

    def append(self, transactions: Sequence[Transaction]) -> int:
        """The batch's change rows in one commit; nothing when the log holds the batch already.
        A spilled transaction is written a piece at a time (``piece_bytes`` of messages), so the
        driver never holds it whole; the pieces become visible together, in the batch's one commit.
        Returns the rows appended."""
        if not transactions:
            return 0
        self._ensure_writing()
        self.pieces_written = 0
        if self._version is not None:
            # Read again after a crash, a batch may be cut differently: the transactions the log
            # holds are dropped, the rest appended.
            transactions = [t for t in transactions if t.commit_lsn > self._version]
            if not transactions:
                return 0
        version = transactions[-1].commit_lsn
        read_at = self.target.log_version()
        files = self.target.open_file_append(("relation_oid",), self.app_id, read_at, storage=self.storage)
        if files is not None and self._takes_layout(files.fields):
            written = self._write_files(files, transactions)
            rows = sum(file.rows for file in written)
            # The only writer of the log, this pipeline read the version it holds (``ensure``) and
            # has written every version since: the log does not hold this one.
            files.commit(written, self._metadata(transactions, rows), version)
        elif (append := self.target.open_known_version_append(self.app_id, read_at)) is not None and \
                (rows := self._write_frames(append, transactions)) is not None:  # a catalog table, object storage
            append.commit(version, self._metadata(transactions, rows))
        else:  # the table's columns are not this layout's: Delta's own checked append says why
            table = self._table([b for batches in self._parts(transactions) for b in batches])
            with staging_scope():
                self.target.write(self._frame(table), "append",
                                  **delta_write_options(self.app_id, version, self._metadata(transactions,
                                                                                             table.num_rows)))
            rows = table.num_rows
        if self.pieces_written:
            log.info("change log: %d rows, %d piece(s) of spilled transactions, in one commit", rows,
                     self.pieces_written)
        self._version = version
        return rows

    def _metadata(self, transactions: Sequence[Transaction], rows: int) -> str:
        return json.dumps({"cdc_apply": "changelog", "pipeline": self.pipeline, "rows": rows,
                           "first_lsn": format_lsn(transactions[0].commit_lsn),
                           "last_lsn": format_lsn(transactions[-1].commit_lsn)}, sort_keys=True)

    def _takes_layout(self, fields: list[dict[str, Any]]) -> bool:
        """Whether the table's columns are this layout's (else Delta's own append says what differs)."""
        from pyspark.sql.types import StructType

        if self._layout_types is None:
            self._layout_types = {f.name: f.dataType for f in self.spark.createDataFrame([], SPARK_DDL).schema.fields}
        table = StructType.fromJson({"type": "struct", "fields": fields})
        return {f.name: f.dataType for f in table.fields} == self._layout_types

    def _parts(self, transactions: Sequence[Transaction]) -> Iterator[list[pa.RecordBatch]]:
        """The batch's change rows in parts, lazily: the transactions held in memory, then each
        spilled one a piece at a time (``piece_bytes`` of messages), so the driver never holds it
        whole. Counts the pieces in ``pieces_written``."""
        self.pieces_written = 0
        yield list(record_batches([t for t in transactions if not isinstance(t.changes, SpilledChanges)]))
        for txn in transactions:
            if isinstance(txn.changes, SpilledChanges):
                for piece in txn.changes.pieces(self.piece_bytes):
                    self.pieces_written += 1
                    if self.pieces_written % 16 == 0:
                        # py4j lets a written frame's rows go only when the cycle collector runs (``_write_frames``)
                        gc.collect()
                    yield list(record_batches([replace(txn, changes=piece)]))

    def _write_frames(self, append: KnownVersionAppend, transactions: Sequence[Transaction]) -> int | None:
        """Each part's rows as one frame written into files of ``append``; the rows written, or None
        when the table did not take a frame."""
        rows = 0
        for batches in self._parts(transactions):
            table = self._table(batches)
            if table.num_rows:
                with staging_scope():
                    if not append.write(self._frame(table)):
                        return None
                rows += table.num_rows
        return rows

    def _write_files(self, files: FileAppend, transactions: Sequence[Transaction]) -> list[WrittenFile]:
        """Each part's rows in one Parquet file per table (``relation_oid``: the partition), in the
        table's directory; the files, for ``files`` to commit."""
        written = []
        for batches in self._parts(transactions):
            by_relation: dict[int, list[pa.RecordBatch]] = {}
            for batch in batches:  # one table's segment, as record_batches cuts them
                oids = pc.unique(batch["relation_oid"]).to_pylist()
                for oid in oids:
                    rows = batch if len(oids) == 1 else batch.filter(pc.equal(batch["relation_oid"], oid))
                    by_relation.setdefault(oid, []).append(rows.drop_columns(["relation_oid"]))
            for oid, group in by_relation.items():
                if (file := write_log_file(self.target.file_root(self.storage), oid, group)) is not None:
                    written.append(file)
        return written

    @staticmethod
    def _table(batches: list[pa.RecordBatch]) -> pa.Table:
        return pa.Table.from_batches(batches, SOURCE_SCHEMA) if batches else SOURCE_SCHEMA.empty_table()

    @property
    def trimmed_through(self) -> int | None:
        """The commit LSN up to which ``trim`` removed the log's rows (None: it holds every batch since
        its start)."""
        self.ensure()
        text = self.target.properties().get(TRIMMED_PROPERTY)
        return parse_lsn(text) if text else None

    def refuse_if_trimmed_past(self, table: str, holds: int | None) -> None:
        """Refuses to bring ``table`` (whose target holds the log up to ``holds``; None: nothing) up to
        date from a log trimmed past that: the changes in between are gone."""
        trimmed = self.trimmed_through
        if trimmed is not None and (holds is None or holds < trimmed):
            raise ChangeLogError(
                f"{table}: the change log {self.target.location} was trimmed through LSN {format_lsn(trimmed)} "
                f"(its retention), and the target holds changes only up to "
                f"{'nothing' if holds is None else format_lsn(holds)}: the changes in between are no longer in the "
                "log. Rebuild this table by a resync (cdc-apply resync), not from the log")

    def record_copy(self, oid: int, table: str, consistent_lsn: int, rows: int | None, logged: bool = False) -> None:
        """A copy of ``table`` from the snapshot at ``consistent_lsn`` starts (``rows=None``) or ended
        with ``rows`` rows, ``logged`` when the log holds them all. Recorded before it starts: a crash
        then leaves it recorded, rows unknown, not logged."""
        self.ensure()
        value = json.dumps({"table": table, "lsn": format_lsn(consistent_lsn), "rows": rows, "logged": logged},
                           sort_keys=True)
        self.spark.sql(f"ALTER TABLE {self.target.sql} SET TBLPROPERTIES ({sql_string(COPIED_PROPERTY + str(oid))} = "
                       f"{sql_string(value)})")

    def copy_log(self, relation: m.Relation, version: int, commit_ts: int, seqs: int) -> CopyLog | None:
        """Where an attempt at copying ``relation`` at ``version`` (commit time ``commit_ts``) puts its rows
        in the log, needing ``seqs`` seqs; its Truncate row is committed first. Files committed by Delta's
        internal classes where the session has them, else rows for Delta's writer (``CopyLog.by_writer``:
        Spark Connect, a log by catalog name). None when the copy cannot be logged: too many rows for the
        int32 ``seq`` column, or a log whose columns are not this layout's."""
        self.ensure()
        files = self.target.open_file_append(("relation_oid",), storage=self.storage)
        if files is not None and not self._takes_layout(files.fields):
            return None
        frame = self.target.read()
        held = frame.where((frame["relation_oid"] == relation.oid) & (frame["commit_lsn"] == version)) \
            .agg({"seq": "max"}).collect()[0][0]
        first = 0 if held is None else held + 1  # an earlier attempt at the same version: after its rows
        if first + seqs > MAX_SEQ:
            log.warning("%s.%s: the copy's rows are not written to the change log: it would need seqs up to %d, "
                        "past the int32 column's %d (a rebuild of this table from the log is refused)",
                        relation.namespace, relation.name, first + seqs, MAX_SEQ)
            return None
        copy = CopyLog(self.target.file_root(self.storage), relation, version, commit_ts, first, by_writer=files is None)
        if copy.by_writer:
            self.append_copy(copy, [copy.truncate()])
            return copy
        truncate = copy.write([copy.truncate()])
        assert truncate is not None
        self.commit_copy([truncate], relation, version, files)
        return copy

    def commit_copy(self, written: Sequence[WrittenFile], relation: m.Relation, version: int,
                    files: FileAppend | None = None) -> None:
        """Files of a copy's rows (``CopyLog``) in one commit of the log, without the batches' version:
        whether the log holds a copy is recorded by ``record_copy(logged=True)`` once it ends."""
        files = files or self.target.open_file_append(("relation_oid",), storage=self.storage)
        if files is None:
            raise ChangeLogError(f"{self.target.location}: the change log no longer takes files written outside "
                                 f"Delta's writer; the copy of {relation.namespace}.{relation.name} stops")
        files.commit(written, self._copy_metadata(relation, version, sum(file.rows for file in written)))

    def append_copy(self, copy: CopyLog, batches: Sequence[pa.RecordBatch]) -> None:
        """A copy's rows (``CopyLog.by_writer``) appended by Delta's writer in one commit of the log."""
        table = self._table([copy.rows_for_writer(batch) for batch in batches])
        with staging_scope():
            self.append_copy_frame(copy, self._frame(table), table.num_rows)

    def _frame(self, table: pa.Table) -> DataFrame:
        """The layout's rows as a DataFrame: a large part staged as Parquet (``apply/staging.py``)."""
        return self.target.staging.frame(self.spark, table, SPARK_DDL)

    def append_copy_frame(self, copy: CopyLog, frame: DataFrame, rows: int | None = None) -> None:
        """``frame`` (the layout's rows of a copy, ``CopyLog.rows_for_writer``) appended by Delta's writer
        in one commit of the log, without the batches' version."""
        self.target.write(frame, "append", userMetadata=self._copy_metadata(copy.relation, copy.version, rows))

    def _copy_metadata(self, relation: m.Relation, version: int, rows: int | None) -> str:
        return json.dumps({"cdc_apply": "changelog copy", "pipeline": self.pipeline, "relation_oid": relation.oid,
                           "version": format_lsn(version), "rows": rows}, sort_keys=True)

    def copies(self) -> dict[int, RecordedCopy]:
        """The tables' last copies, by relation oid (``record_copy``)."""
        self.ensure()
        copies = {}
        for key, value in self.target.properties().items():
            if key.startswith(COPIED_PROPERTY):
                fields = json.loads(value)
                copies[int(key[len(COPIED_PROPERTY):])] = RecordedCopy(fields["table"], parse_lsn(fields["lsn"]),
                                                                       fields["rows"], bool(fields.get("logged")))
        return copies

    def refuse_if_copy_missing(self, oid: int, copy: RecordedCopy, holds: int | None, until_lsn: int | None = None) -> None:
        """Refuses to bring a table up to date from the log (up to ``until_lsn``; None: all of it) when its
        rows came from a copy its target (holding the log up to ``holds``; None: nothing) does not hold,
        and the log lacks the copy's rows, or the rebuild ends before the copy."""
        if copy.rows == 0 or (holds is not None and holds >= copy.version):
            return
        rows = "an unknown number of" if copy.rows is None else f"{copy.rows}"
        if copy.logged:
            if until_lsn is None or until_lsn >= copy.version:
                return
            raise ChangeLogError(
                f"{copy.table} (relation {oid}): its rows came from an initial copy at LSN {format_lsn(copy.lsn)} "
                f"({rows} rows), after LSN {format_lsn(until_lsn)}: the change log {self.target.location} holds the "
                "table from that copy on, so it cannot rebuild the table as of an earlier LSN")
        raise ChangeLogError(
            f"{copy.table} (relation {oid}): its target began with an initial copy at LSN {format_lsn(copy.lsn)} "
            f"({rows} rows), and a copy's rows are not in the change log {self.target.location}; the target holds "
            f"{'nothing' if holds is None else 'changes only up to ' + format_lsn(holds)}, so a rebuild from the log "
            "would lack them. Rebuild this table by a resync (cdc-apply resync), or replay into a warehouse whose "
            "target holds the copy")

    def last_lsn_committed_before(self, unix_seconds: float) -> int | None:
        """The commit LSN of the last transaction in the log committed before ``unix_seconds``."""
        from pyspark.sql import functions as F

        self.ensure()
        frame = self.target.read()
        row = frame.where(frame["commit_ts"] < F.timestamp_seconds(F.lit(unix_seconds))) \
            .agg(F.max("commit_lsn")).collect()[0]
        return row[0]

    def trim(self, through: int) -> int:
        """Removes the rows of transactions committed at or before ``through``, after recording it
        (``cdc_apply.changelog.trimmed_through``), so that a replay that would need them is refused.
        Returns the rows removed; the files go at the next ``VACUUM``."""
        self.ensure()
        before = self.trimmed_through
        if before is None or through > before:
            self.spark.sql(f"ALTER TABLE {self.target.sql} SET TBLPROPERTIES ({sql_string(TRIMMED_PROPERTY)} = "
                           f"{sql_string(format_lsn(through))})")
        metrics = self.spark.sql(f"DELETE FROM {self.target.sql} WHERE commit_lsn <= {int(through)}").collect()
        return int(metrics[0][0]) if metrics and metrics[0][0] is not None else 0

    def read(self, table: str | None = None, until_lsn: int | None = None, after: int | None = None,
             copies: bool = True) -> DataFrame:
        """The log's rows (of one table, ``schema.table``; after and up to a commit LSN), in no order;
        without the rows of copies unless ``copies`` (the targets' followers: a copy writes its target)."""
        self.ensure()
        frame = self.target.read()
        if not copies:
            frame = frame.where(frame["xid"] != COPY_XID)
        if table is not None:
            schema, _, name = table.partition(".")
            frame = frame.where((frame["schema"] == schema) & (frame["table"] == name))
        if after is not None:
            frame = frame.where(frame["commit_lsn"] > after)
        if until_lsn is not None:
            frame = frame.where(frame["commit_lsn"] <= until_lsn)
        return frame
