"""``spark.read.format("pgoutput")`` and ``spark.readStream.format("pgoutput")``.

Batch reads take capture files (``.load(paths)``) or peek a slot without consuming it. A
streaming read follows a slot with offsets that are LSNs.

Invariants (tests/test_datasource.py):
- Offsets are transaction end LSNs: a micro-batch holds every transaction whose commit ends in
  (start, end], whole; a transaction is never split between batches.
- The slot moves only to positions the sink holds: ``commit(end)``, which Spark calls after the
  batch's sink has committed, and ``latestOffset(start)``, which Spark calls only once the batch
  ending at ``start`` has committed (it runs one batch at a time; without this an idle query
  would hold its last batch's WAL, since Spark commits a batch's source offsets only when it
  plans the next batch). Either confirms through the replication core (``cdc_apply.replication``):
  to that end or, when a streamed or prepared transaction is still undecided, to its start.
- An idle query (no published change) moves its offset over other WAL by the core's idle-advance
  policy, at least a WAL segment at a time (each move is an empty batch), so a quiet
  publication does not hold the server's WAL.
- Reading a range again (a restart from the checkpoint) peeks the slot from its confirmed
  position, which is at or before ``start``, so it gets the same transactions.
- The slot confirmed past ``start`` means someone else consumed it: the read fails, naming both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from cdc_apply.transactions import Transaction
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn, parse_lsn
from cdc_apply.replication import IDLE_ADVANCE_WAL_SEGMENT, ReplicationCore
from cdc_apply.sources.capture import read_captures
from cdc_apply.sources.catalog import SourceCatalog
from cdc_apply.sources.preflight import check_source, ensure_publication_and_slot, protocol_options
from cdc_apply.sources.raw import RawMessage
from cdc_apply.sources.slot import (
    SLOT_GONE, PgOutputOptions, advance_slot, confirmed_flush, current_wal_lsn, read_changes, server_version_num,
    slot_exists,
)
from cdc_apply.spark.reader_options import ReaderOptions, reader_options
from cdc_apply.spark.rows import SPARK_DDL, record_batches, typed_schema
from cdc_apply.spark.typed import TableImages, images_from_catalog, images_from_relations

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class PgOutputDataSource(DataSource):
    """Change rows (``cdc_apply.spark.rows``) from capture files or a replication slot."""

    @classmethod
    def name(cls) -> str:
        return "pgoutput"

    def schema(self) -> str:
        images = table_images(reader_options(self.options))
        return SPARK_DDL if images is None else typed_schema(images)[1]

    def reader(self, schema: object) -> DataSourceReader:
        options = reader_options(self.options)
        return PgOutputBatchReader(options, table_images(options))

    def streamReader(self, schema: object) -> DataSourceStreamReader:
        options = reader_options(self.options)
        if options.paths:
            raise CdcApplyError("pgoutput option path: a streaming read follows a slot, not capture files")
        return PgOutputStreamReader(options, table_images(options))


def table_images(options: ReaderOptions) -> TableImages | None:
    """The read schema of the ``table`` option's images: from the files, or the catalog now.

    Spark asks for the schema and builds the reader in different processes, so each reads it."""
    if options.table is None:
        return None
    if options.paths:
        _, core = _assembled(list(read_captures(options.paths)), options)
        return images_from_relations(core.assembler.relations.values(), core.assembler.types.values(), options.table,
                                     ", ".join(options.paths))
    with psycopg.connect(options.source.conninfo(), autocommit=True) as conn:
        return images_from_catalog(conn, options.source.publications, options.table)


@dataclass
class SlotRange(InputPartition):
    """Transactions ending in (start, end]; ``lsns``/``datas``: the messages, when already read."""

    start: int
    end: int
    lsns: list[int] | None = None
    datas: list[bytes] | None = None


@dataclass
class CaptureFiles(InputPartition):
    paths: tuple[str, ...]


def _protocol(conn: psycopg.Connection, options: ReaderOptions) -> PgOutputOptions:
    return protocol_options(options.source, server_version_num(conn))


def _core(options: ReaderOptions, conn: psycopg.Connection | None = None) -> ReplicationCore:
    """A replication core whose sink is Spark's: the caller takes the transactions. With ``conn``
    it confirms by advancing the slot, starting from the slot's confirmed position."""
    # Capture files carry the catalog's facts about their types on the Type messages' rows; a slot's
    # messages are read with the source's catalog at hand.
    type_facts = None if options.paths else SourceCatalog(options.source.conninfo()).type_facts
    if conn is None:
        return ReplicationCore(None, spill_bytes=options.spill_bytes, skip_origins=options.source.skip_origins,
                               type_facts=type_facts)
    slot = options.source.slot
    return ReplicationCore(None, lambda lsn: advance_slot(conn, slot, lsn), confirmed=confirmed_flush(conn, slot),
                           spill_bytes=options.spill_bytes, skip_origins=options.source.skip_origins,
                           idle_advance_bytes=IDLE_ADVANCE_WAL_SEGMENT, type_facts=type_facts)


def _assembled(raws: list[RawMessage], options: ReaderOptions) -> tuple[list[Transaction], ReplicationCore]:
    with _core(options) as core:
        core.feed(raws)
        return core.take(), core


class PgOutputBatchReader(DataSourceReader):
    def __init__(self, options: ReaderOptions, images: TableImages | None) -> None:
        self.options = options
        self.images = images

    def partitions(self) -> Sequence[InputPartition]:
        # The files of one capture are one stream: Relation messages in one apply to the next.
        if self.options.paths:
            return [CaptureFiles(self.options.paths)]
        with psycopg.connect(self.options.source.conninfo(), autocommit=True) as conn:
            start = confirmed_flush(conn, self.options.source.slot)
            end = current_wal_lsn(conn)
        return [SlotRange(start, end)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, CaptureFiles):
            transactions, _ = _assembled(list(read_captures(partition.paths)), self.options)
            yield from record_batches(transactions, images=self.images)
            return
        assert isinstance(partition, SlotRange)
        yield from _read_range(self.options, partition, self.images)


def _require_slot(conn: psycopg.Connection, slot: str, checkpoint_lsn: str) -> None:
    """A query resumed from a checkpoint never creates its slot again: a new slot would start now."""
    if not slot_exists(conn, slot):
        raise CdcApplyError(
            f"replication slot {slot!r} does not exist on {conn.info.host}:{conn.info.port}, but this query's "
            f"checkpoint is at LSN {checkpoint_lsn}: {SLOT_GONE}. Stop the query first, and start it again with a "
            "new checkpoint location")


def _read_range(options: ReaderOptions, part: SlotRange, images: TableImages | None) -> Iterator[pa.RecordBatch]:
    if part.datas is None:
        with psycopg.connect(options.source.conninfo(), autocommit=True) as conn:
            confirmed = confirmed_flush(conn, options.source.slot)
            if confirmed > part.start:
                raise CdcApplyError(
                    f"slot {options.source.slot} is confirmed to {format_lsn(confirmed)}, past this batch's start "
                    f"{format_lsn(part.start)}: another consumer advanced it, or the checkpoint belongs to "
                    "another slot; the changes in between are gone from it")
            raws = list(read_changes(conn, options.source.slot, _protocol(conn, options), upto_lsn=part.end))
    else:
        raws = [RawMessage(lsn, None, data, f"slot {options.source.slot}")
                for lsn, data in zip(part.lsns or [], part.datas, strict=True)]
    transactions, _ = _assembled(raws, options)
    yield from record_batches((t for t in transactions if part.start < t.end_lsn <= part.end), images=images)


class PgOutputStreamReader(DataSourceStreamReader):
    def __init__(self, options: ReaderOptions, images: TableImages | None) -> None:
        self.options = options
        self.images = images
        self._prefetched: SlotRange | None = None
        self._confirm: dict[int, int] = {}  # end offset -> the LSN the slot may be confirmed to

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.options.source.conninfo(), autocommit=True)

    def initialOffset(self) -> dict:
        with self._connect() as conn:
            check_source(conn, self.options.source, lambda schema, table: False, copies=False)
            ensure_publication_and_slot(conn, self.options.source)
            return {"lsn": format_lsn(confirmed_flush(conn, self.options.source.slot))}

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_changes_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the last whole transaction within the limit (``start`` when there is none)."""
        begin = parse_lsn(start["lsn"])
        window = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        source = self.options.source
        with self._connect() as conn:
            _require_slot(conn, source.slot, start["lsn"])
            protocol = _protocol(conn, self.options)
            upto = current_wal_lsn(conn)
            while True:
                raws = list(read_changes(conn, source.slot, protocol, upto_lsn=upto, upto_nchanges=window))
                with _core(self.options, conn) as core:
                    core.feed(raws)
                    fresh = [t for t in core.take() if t.end_lsn > begin]
                    if fresh or window is None or len(raws) < window:
                        core.confirm_up_to(begin)  # the batch ending at start is committed (see above)
                        break
                window *= 2  # the slot still holds transactions before start, or one is larger than the window
        if not fresh:
            return start if core.idle_position(upto) is None else {"lsn": format_lsn(upto)}
        end = fresh[-1].end_lsn
        self._confirm[end] = core.confirmable(end)
        self._prefetched = SlotRange(begin, end, [r.lsn for r in raws], [r.data for r in raws])
        return {"lsn": format_lsn(end)}

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        begin, finish = parse_lsn(start["lsn"]), parse_lsn(end["lsn"])
        if begin >= finish:
            return []
        cached = self._prefetched
        self._prefetched = None
        if cached is not None and (cached.start, cached.end) == (begin, finish):
            return [cached]
        return [SlotRange(begin, finish)]  # a restart: the range is read again from the slot

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SlotRange)
        yield from _read_range(self.options, partition, self.images)

    def commit(self, end: dict) -> None:
        finish = parse_lsn(end["lsn"])
        planned = self._confirm.pop(finish, None)
        with self._connect() as conn, _core(self.options, conn) as core:
            if planned is None:  # not planned by this reader (the first batch after a restart)
                core.feed(list(read_changes(conn, self.options.source.slot, _protocol(conn, self.options),
                                            upto_lsn=finish)))
                core.take()
                planned = finish
            core.confirm_up_to(planned)
        for stale in [lsn for lsn in self._confirm if lsn <= finish]:
            del self._confirm[stale]


def register(spark: SparkSession) -> None:
    """Make ``format("pgoutput")`` available in this Spark session."""
    spark.dataSource.register(PgOutputDataSource)
