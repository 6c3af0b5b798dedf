"""Targets brought up to date from the change log: ``changelog.confirm_after: changelog`` and
``cdc-apply replay --changelog`` (docs/change-log-table.md).

The log's rows are read in windows of whole transactions, turned back into transactions as
``foreach_batch`` turns a micro-batch (``spark.foreach.micro_batch_changes``: the Relation in force
and the message bytes each row holds), and applied by a ``BatchApplier`` with the same per-table
versions as the run that wrote them.

Invariants:
- A window commits to each target with ``txnVersion`` = its last commit LSN; a window applied again
  (after a crash, or a replay into the live warehouse) is skipped by those versions, so reading from
  too early an LSN is only slower, never wrong.
- ``AppliedPosition`` (``<warehouse>/_cdc_apply/changelog_applied/<pipeline>.json``) is written after a
  window's target commits are durable: it is a lower bound of what every target holds, so a
  restart re-reads at most one window.
- ``TargetFollower`` is the only writer of the targets' change commits in ``confirm_after:
  changelog`` mode, in its own Spark session (the commit confs are session state); the stream's
  thread only appends to the log and copies new tables, before their changes reach the log.
- The follower applies batches handed over in memory only while they continue the recorded position
  without a gap (``TargetFollower._take_queue``); otherwise it reads the log, which holds every
  batch the stream was told is durable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cdc_apply.apply.session_kind import default_parallelism
from cdc_apply.apply.batch import BatchApplier, BatchResult, TableResult
from cdc_apply.apply.plan import Versioning
from cdc_apply.apply.options import MAX_PIECE_BYTES
from cdc_apply.lake.state import AppliedPosition
from cdc_apply.transactions import DEFAULT_SPILL_BYTES, ChangeBuffer, SpilledChanges, Transaction
from cdc_apply.changelog.log import ChangeLog
from cdc_apply.lsn import PG_EPOCH_OFFSET_US, format_lsn
from cdc_apply.spark.foreach import APPLY_COLUMNS, ROW_COLUMNS, micro_batch_changes, relation_of
from cdc_apply.changelog.log_collapse import REFUSED, collapse_on_executors, groups_for

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row

    from cdc_apply.changerows.codec import PortableCodec

log = logging.getLogger(__name__)

Applied = Callable[[BatchResult, list[Transaction]], None]  # told each window applied


@dataclass(frozen=True)
class Window:
    """Consecutive transactions of the log, applied together."""

    first_lsn: int
    last_lsn: int
    rows: int
    message_bytes: int  # of the changes' messages (``_cdc_change``)


def transaction_windows(per_transaction: list[tuple[int, int, int]], max_changes: int, max_bytes: int) -> list[Window]:
    """Windows of about ``max_changes`` rows or ``max_bytes`` of messages, whichever comes first, from
    (commit LSN, rows, message bytes) per transaction: a transaction past ``max_bytes`` is a window
    of its own (it is read in pieces). Whole transactions only, so a window may pass either bound."""
    windows: list[Window] = []
    start, end, rows, size = None, 0, 0, 0
    for lsn, count, nbytes in per_transaction:
        alone = nbytes > max_bytes
        if start is not None and alone:  # the window so far, then this one
            windows.append(Window(start, end, rows, size))
            start, rows, size = None, 0, 0
        if start is None:
            start = lsn
        end, rows, size = lsn, rows + count, size + nbytes
        if rows >= max_changes or size >= max_bytes:
            windows.append(Window(start, end, rows, size))
            start, rows, size = None, 0, 0
    if start is not None:
        windows.append(Window(start, end, rows, size))
    return windows


# percentile_approx's accuracy for the pieces' cuts: a piece's rows are right within 1/this of the whole.
PIECE_CUT_ACCURACY = 10_000


class ChangeLogApplier:
    """Applies the change log's transactions to the targets of ``applier``'s warehouse."""

    def __init__(self, changelog: ChangeLog, applier: BatchApplier, *, max_changes: int,
                 position: AppliedPosition | None = None, applied: Applied | None = None,
                 spill_bytes: int = DEFAULT_SPILL_BYTES) -> None:
        """``position``: where ``catch_up`` starts and what it records; ``applied``: told each window;
        ``spill_bytes``: windows end at this many bytes of messages, and a transaction past it is read
        in pieces into a spill file, as the stream spills one."""
        self.changelog = changelog
        self.applier = applier
        self.max_changes = max_changes
        self.spill_bytes = spill_bytes
        self.piece_bytes = min(MAX_PIECE_BYTES, spill_bytes)
        self.position = position
        self.applied = applied

    def windows(self, frame: DataFrame) -> list[Window]:
        """``frame``'s transactions (rows of the log) cut into windows, in commit order. A window's rows
        go through the JVM and Python together, their text images on top of the messages: windows end
        at spill_bytes of messages too. A transaction past that is read in pieces into a spill file, as
        the stream spills one; below it, it is held whole, as the stream holds it."""
        from pyspark.sql import functions as F

        per_transaction = frame.groupBy("commit_lsn").agg(F.count("*"), F.sum(F.length("_cdc_change"))) \
            .orderBy("commit_lsn").collect()
        return transaction_windows([(lsn, rows, nbytes or 0) for lsn, rows, nbytes in per_transaction],
                                   self.max_changes, self.spill_bytes)

    def apply(self, frame: DataFrame, advance: Callable[[int], None] | None = None,
              stopping: threading.Event | None = None, windows: list[Window] | None = None) -> list[BatchResult]:
        """``frame``'s transactions, window by window (``windows``, default ``self.windows(frame)``);
        when ``stopping`` is set, none after the window being applied."""
        results = []
        for window in self.windows(frame) if windows is None else windows:
            if stopping is not None and stopping.is_set():
                break
            first, last, rows = window.first_lsn, window.last_lsn, window.rows
            frame_of = frame.where((frame["commit_lsn"] >= first) & (frame["commit_lsn"] <= last))
            if first == last and window.message_bytes > self.spill_bytes:
                result, transactions = self._large_transaction(frame_of)
            else:
                transactions, parsed = micro_batch_changes(frame_of.select(*APPLY_COLUMNS, *ROW_COLUMNS).toArrow())
                result = self.applier.apply(transactions, parsed=parsed)
            results.append(result)
            if self.position is not None:
                self.position.write(last)
            if self.applied is not None:
                self.applied(result, transactions)
            if advance is not None:
                advance(rows)
        return results

    def _large_transaction(self, window: DataFrame) -> tuple[BatchResult, list[Transaction]]:
        """The one transaction of ``window``, past spill_bytes: each table the executors take is collapsed
        and merged by Spark (``_tables_on_executors``); the other tables (inserts only: appended in
        pieces; a schema change, a truncate, a table the executors' collapse refuses) are read in
        pieces into a spill file and applied as the stream applies a spilled transaction (``_spilled``)."""
        from pyspark.sql import functions as F

        started = time.perf_counter()
        found = self._tables_on_executors(window)
        assert found is not None, "a window holds at least one row"
        transaction, applied, on_driver = found
        if on_driver:
            rest = window.where(F.col("relation_oid").isin(list(on_driver)))
            spilled = self._spilled(rest, list(on_driver.values()))
            transaction = replace(spilled, changes=[])
            applied += self.applier.apply([spilled]).tables
        lsn = transaction.commit_lsn
        return BatchResult(1, lsn, lsn, applied, time.perf_counter() - started), [transaction]

    def apply_on_executors(self, transaction: Transaction) -> BatchResult | None:
        """A spilled transaction of the stream that the log holds already (``confirm_after: targets``):
        its tables collapsed and merged by Spark from the log. None when a table is left for the
        driver's apply, which then skips the tables applied here by their versions."""
        started = time.perf_counter()
        lsn = transaction.commit_lsn
        found = self._tables_on_executors(self.changelog.read(after=lsn - 1, until_lsn=lsn, copies=False))
        if found is None or found[2]:
            return None
        return BatchResult(1, lsn, lsn, found[1], time.perf_counter() - started)

    def _tables_on_executors(self, window: DataFrame) -> tuple[Transaction, list[TableResult], dict[int, Row]] | None:
        """The one transaction of ``window`` (its head, without changes), the results of the tables Spark
        collapsed and merged (those with updates or deletes under one Relation definition, no truncate),
        and the others' aggregates (rows per op, message bytes, lowest and highest ``seq``) by relation
        OID, for the driver; None when ``window`` is empty."""
        from pyspark.sql import functions as F

        tables = window.groupBy("relation_oid").agg(
            F.count_distinct("_cdc_relation").alias("definitions"), F.first("_cdc_relation").alias("relation"),
            *(F.count_if(F.col("op") == op).alias(op) for op in "IUDT"),
            F.sum(F.length("_cdc_change")).alias("message_bytes"), F.min("seq").alias("low_seq"),
            F.max("seq").alias("high_seq"), F.first("xid").alias("xid"),
            F.first("end_lsn").alias("end_lsn"), F.unix_micros(F.first("commit_ts")).alias("commit_us"),
            F.first("origin").alias("origin"), F.first("commit_lsn").alias("commit_lsn")).collect()
        if not tables:
            return None
        head = tables[0]
        lsn = head["commit_lsn"]
        transaction = Transaction(head["xid"], lsn, head["end_lsn"], head["commit_us"] - PG_EPOCH_OFFSET_US, [],
                                  origin=head["origin"])
        applied: list[TableResult] = []
        on_driver: dict[int, Row] = {}
        for table in tables:
            result = None
            if table["definitions"] == 1 and not table["T"] and (table["U"] or table["D"]):
                result = self._on_executors(window.where(F.col("relation_oid") == table["relation_oid"]), table, lsn)
            if result is None:
                on_driver[table["relation_oid"]] = table
            else:
                applied.append(result)
        return transaction, applied, on_driver

    def _on_executors(self, rows: DataFrame, table: Row, lsn: int) -> TableResult | None:
        """One table's rows of a large transaction collapsed and merged by Spark; None when the driver
        must apply them (the applier declines the table, or the executors' collapse refused a group:
        the MERGE failed, so nothing was committed)."""
        relation = relation_of(table["relation"], lsn)
        groups = groups_for(table["message_bytes"] or 0, default_parallelism(rows.sparkSession))

        def collapse(codec: PortableCodec, column_map: dict[str, str | None], keys: tuple[str, ...],
                     data_types: dict[str, str], after: int | None) -> DataFrame:
            return collapse_on_executors(rows, codec, column_map, keys, data_types, after, groups)

        counts = Counter({op: table[op] for op in "IUD" if table[op]})
        try:
            return self.applier.apply_table_collapsed_by(relation, Versioning(lsn), collapse, counts, lsn, lsn)
        except Exception as exc:  # noqa: BLE001 - the MERGE is atomic: the driver's apply takes over
            reason = str(exc).strip().splitlines()
            log.warning("%s.%s at %s: collapsing on the executors failed, applying it on the driver: %s",
                        relation.namespace, relation.name, format_lsn(lsn),
                        next((line for line in reason if REFUSED in line), reason[0] if reason else type(exc).__name__))
            return None

    def _spilled(self, window: DataFrame, tables: list[Row]) -> Transaction:
        """The one transaction of ``window``, read from the log a piece at a time (by its changes'
        ``seq``) into a spill file, as the stream spills a large one: the applier takes it as it takes
        a spilled transaction from the slot, and neither the JVM nor Python holds its rows together
        (collected whole, a 256 MB update ran a 4 GB driver JVM out of heap)."""
        bounds = self._piece_bounds(window, tables)
        buffer = ChangeBuffer(self.spill_bytes, None)
        head: Transaction | None = None
        for start, end in zip(bounds, bounds[1:]):
            piece = window.where((window["seq"] >= start) & (window["seq"] < end))
            for transaction in micro_batch_changes(piece.select(*APPLY_COLUMNS, *ROW_COLUMNS).toArrow())[0]:
                head = head or transaction
                for change in transaction.changes:
                    buffer.append(change, len(change.wire or b""))
        assert head is not None, "a window holds at least one row"
        changes = buffer.finish()
        log.info("change log: the transaction committed at %s (%d changes) read in %d piece(s)%s",
                 format_lsn(head.commit_lsn), len(changes), len(bounds) - 1,
                 ", spilled to disk" if isinstance(changes, SpilledChanges) else "")
        return replace(head, changes=changes)

    def _piece_bounds(self, window: DataFrame, tables: list[Row]) -> list[int]:
        """Where ``window``'s pieces begin, and the end of the last (exclusive), from its ``tables``'
        aggregates (``_tables_on_executors``, so only the cuts need a Spark job): pieces of about
        piece_bytes of messages (as the log was appended) and at most about max_changes rows (their
        text images come on top: a piece of 400 MB of rows once lost its task result to memory
        pressure), cut at quantiles of the rows' ``seq``. Not at equal steps of ``seq``: a copy logged
        by Spark's tasks numbers its rows by page slots, most of them unused, so equal steps held a
        few rows each."""
        from pyspark.sql import functions as F

        message_bytes = sum(table["message_bytes"] or 0 for table in tables)
        rows = sum(table[op] for table in tables for op in "IUDT")
        low, high = min(table["low_seq"] for table in tables), max(table["high_seq"] for table in tables)
        pieces = max(1, -(-message_bytes // self.piece_bytes), -(-rows // self.max_changes))
        cuts: list[int] = []
        if pieces > 1:
            fractions = [index / pieces for index in range(1, pieces)]
            cuts = window.agg(F.percentile_approx("seq", fractions, PIECE_CUT_ACCURACY)).first()[0]  # type: ignore[index]
        return sorted({low, *cuts, high + 1})

    def apply_logged(self, transactions: list[Transaction]) -> BatchResult | None:
        """Transactions the log holds, handed over in memory by the stream right after it appended them
        and following on from the recorded position: applied, and the position moved past them."""
        assert self.position is not None, "apply_logged records a position"
        after = self.position.read()
        transactions = [t for t in transactions if after is None or t.commit_lsn > after]
        if not transactions:
            return None
        result = self.applier.apply(transactions)
        self.position.write(transactions[-1].commit_lsn)
        if self.applied is not None:
            self.applied(result, transactions)
        return result

    def catch_up(self, until: int | None = None, stopping: threading.Event | None = None) -> list[BatchResult]:
        """Every transaction the log holds past the recorded position (up to ``until``, default: what
        the log holds now) applied; the position recorded window by window (``stopping``: see ``apply``)."""
        assert self.position is not None, "catch_up records a position"
        after = self.position.read()
        held = self.changelog.version if until is None else until
        if held is None or (after is not None and held <= after):
            return []
        self.changelog.refuse_if_trimmed_past(f"the targets of {self.applier.options.warehouse}", after)
        frame = self.changelog.read(after=after, until_lsn=held, copies=False)  # a copy wrote its target itself
        log.info("bringing the targets up to date from the change log: %s .. %s",
                 "the start" if after is None else format_lsn(after), format_lsn(held))
        results = self.apply(frame, stopping=stopping)
        if stopping is None or not stopping.is_set():
            self.position.write(held)  # also past a tail of the log that held no rows of a published table
        return results
