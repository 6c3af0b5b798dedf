"""The replication core: raw messages -> committed transactions -> batches -> sink -> durable -> confirm.

Every runner drives this module (``run --once``, ``run --follow``, ``replay``, ``capture
--consume``, the Spark data source's offsets); they differ only in how raw messages arrive and in
the ``confirm`` they pass in: pg_replication_slot_advance, a walsender status update, nothing for
files. This is the only module that decides how far a slot may be confirmed
(docs/architecture.md, "Invariants" 1, 6 and 7).

Invariants:
- **Durable before confirmed.** ``flush`` hands the pending transactions to the sink, and calls
  ``confirm`` only after the sink returned, i.e. every target's Delta commit is durable.
- **Never past a transaction in flight.** Every position given to ``confirm`` goes through
  ``Assembler.safe_confirm_lsn``: not past an open Begin..Commit, an open streamed transaction or
  a prepared one whose outcome has not arrived.
- **Monotonic.** ``confirm`` is called only with a position past the last one confirmed.
- **Whole transactions.** A batch is cut at transaction boundaries, once it holds
  ``max_changes`` changes or its first transaction has waited ``max_seconds``; a transaction
  larger than ``max_changes`` is one batch.
- **Receive while writing** (``start_write``/``finish_write``, ``run --follow``). One batch is
  written at a time, on the caller's writer thread, while the next is received and decoded. A
  batch is whatever arrived while the last one was written: it starts once the writer is free
  and the source has nothing more waiting, or at ``max_changes`` / ``max_seconds``, whichever
  comes first. So batches grow under a backlog and shrink under a light load, and none waits for
  a timer. At ``max_changes`` pending, the driver stops receiving until the write is done (the
  walsender's TCP window holds the rest). The confirm still follows the durable write, on the
  driver's thread.
- **Idle advance, one policy.** With nothing pending and nothing unfinished in the assembler,
  the source's WAL end may be confirmed, so a quiet publication on a busy server does not hold
  its WAL: every later change commits after that point and is sent whole. A source sets
  ``idle_advance_bytes``, the least distance worth a move: 0 for the walsender and ``run
  --once`` (a status update or a slot advance is cheap), one WAL segment for the Spark data
  source (each move there is an empty micro-batch).
- **Restart.** A new core starts at the slot's confirmed position: the server re-sends every
  transaction not confirmed, and the targets' exactly-once versions skip the ones that were
  durable but not yet confirmed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import Protocol

from cdc_apply.assemble import Assembler, TypeFactsLookup
from cdc_apply.transactions import DEFAULT_SPILL_BYTES, Event, Transaction
from cdc_apply.failpoints import failpoint
from cdc_apply.pgoutput.framing import MessageSpans
from cdc_apply.sources.raw import RawMessage

IDLE_ADVANCE_WAL_SEGMENT = 16 * 1024 * 1024


class Sink(Protocol):
    """Where batches go. The contract the core relies on: ``write_batch`` returns only when every
    change of ``batch`` is durable in its target, and writing a batch again (after a crash before
    the confirm) changes nothing."""

    def write_batch(self, batch: list[Transaction]) -> None: ...


Confirm = Callable[[int], None]


@dataclass(frozen=True)
class BatchCut:
    max_changes: int = 1_000_000
    max_seconds: float | None = None  # None: cut on size only (finite inputs)


class ReplicationCore:
    def __init__(self, sink: Sink | None, confirm: Confirm | None = None, *, cut: BatchCut = BatchCut(),
                 confirmed: int = 0, spill_bytes: int | None = None, skip_origins: Iterable[str] = (),
                 idle_advance_bytes: int = 0, type_facts: TypeFactsLookup | None = None) -> None:
        """``sink=None``: the caller takes the transactions (``take``) and writes them itself
        (Spark's micro-batches). ``confirm=None``: nothing to confirm (files). ``confirmed``: the
        position the source is already confirmed to. ``type_facts``: the live source's catalog lookup
        for the types Type messages name (``Assembler``)."""
        self.sink = sink
        self._confirm = confirm
        self.cut = cut
        self.confirmed = confirmed
        self.idle_advance_bytes = idle_advance_bytes
        self.assembler = Assembler(spill_bytes=spill_bytes or DEFAULT_SPILL_BYTES, skip_origins=skip_origins,
                                   type_facts=type_facts)
        self.pending: list[Transaction] = []
        self.pending_changes = 0
        self._pending_since = 0.0
        self._writing: tuple[Future[None], int] | None = None  # the batch being written, its end

    def __enter__(self) -> ReplicationCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.assembler.close()

    # -- receive -----------------------------------------------------------------------------

    def feed(self, raws: Iterable[RawMessage]) -> int:
        """Decode and assemble; committed transactions join the pending batch. Returns their changes."""
        return self._add_committed(self.assembler.events(raws))

    def feed_spans(self, spans: MessageSpans, source: str | None = None) -> int:
        """As ``feed``, for messages received together as spans over one buffer (a walsender read)."""
        return self._add_committed(self.assembler.feed_spans(spans, source))

    def _add_committed(self, events: Iterable[Event]) -> int:
        received = 0
        for event in events:
            if isinstance(event, Transaction):
                received += self._add(event)
        return received

    def write_all(self, raws: Iterable[RawMessage], what: str) -> Iterator[int]:
        """Drive a finite source (capture files): write each batch as soon as it is due, the rest at
        the end, and say which transactions ``what`` cut off. Yields each batch's change count."""
        for event in self.assembler.events(raws):
            if isinstance(event, Transaction):
                self._add(event)
                if self.batch_due():
                    changes = self.pending_changes
                    self.flush()
                    yield changes
        if self.pending:
            changes = self.pending_changes
            self.flush()
            yield changes
        self.assembler.warn_unfinished(what)

    def _add(self, txn: Transaction) -> int:
        if not self.pending:
            self._pending_since = time.monotonic()
        self.pending.append(txn)
        self.pending_changes += len(txn.changes)
        return len(txn.changes)

    def take(self) -> list[Transaction]:
        batch, self.pending, self.pending_changes = self.pending, [], 0
        return batch

    # -- cut ---------------------------------------------------------------------------------

    def batch_due(self) -> bool:
        return bool(self.pending) and (self.pending_changes >= self.cut.max_changes or self.seconds_until_due() <= 0)

    def room(self) -> int:
        """How many more changes the pending batch takes before ``max_changes`` cuts it."""
        return max(0, self.cut.max_changes - self.pending_changes)

    def seconds_until_due(self) -> float:
        """How long the pending batch may still wait (infinite with nothing pending or no time cut)."""
        if not self.pending or self.cut.max_seconds is None:
            return float("inf")
        return self.cut.max_seconds - (time.monotonic() - self._pending_since)

    # -- write and confirm -------------------------------------------------------------------

    def flush(self) -> bool:
        """Write the pending batch, then confirm its end (as far as is safe). True when the
        confirmed position moved."""
        batch = self.take()
        if not batch:
            return False
        assert self.sink is not None, "a core without a sink is flushed by its caller (take)"
        failpoint("after_decode")
        self.sink.write_batch(batch)
        failpoint("before_confirm")
        return self.confirm_up_to(batch[-1].end_lsn)

    def confirmable(self, lsn: int) -> int:
        """The highest position up to ``lsn`` the source may be confirmed to now."""
        return min(lsn, self.assembler.safe_confirm_lsn(lsn))

    def confirm_up_to(self, lsn: int) -> bool:
        """Confirm ``lsn``, or less when a transaction before it is in flight. True when it moved.

        Only for positions whose changes are durable: a batch's end after its sink returned, or
        a position every change before which the caller knows its sink holds."""
        position = self.confirmable(lsn)
        if position <= self.confirmed:
            return False
        if self._confirm is not None:
            self._confirm(position)
        self.confirmed = position
        return True

    # -- write while receiving (pipelined drivers) ---------------------------------------------

    @property
    def writing(self) -> bool:
        return self._writing is not None

    @property
    def writing_end(self) -> int | None:
        """The end of the batch being written, if one is."""
        return None if self._writing is None else self._writing[1]

    def write_ready(self, drained: bool) -> bool:
        """A pipelined driver starts the next batch now: no write is running, and the source had
        nothing more waiting (``drained``) or the batch is due (``max_changes``, ``max_seconds``)."""
        return self._writing is None and bool(self.pending) and (drained or self.batch_due())

    def write_full(self) -> bool:
        """The pending batch has reached ``max_changes`` while a write runs: stop receiving until it ends."""
        return self._writing is not None and self.pending_changes >= self.cut.max_changes

    def start_write(self, writer: Executor) -> None:
        """Hand the pending batch to the sink on ``writer``; ``finish_write`` confirms it."""
        assert self.sink is not None and self._writing is None
        batch = self.take()
        failpoint("after_decode")
        self._writing = (writer.submit(self.sink.write_batch, batch), batch[-1].end_lsn)

    def write_done(self) -> bool:
        return self._writing is not None and self._writing[0].done()

    def finish_write(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for the running write; once it is durable, confirm its end.
        True when the write is finished (its error, if any, is raised here)."""
        assert self._writing is not None
        future, end = self._writing
        if not wait([future], timeout).done:
            return False
        self._writing = None
        future.result()  # the write's error, if it failed
        failpoint("before_confirm")
        self.confirm_up_to(end)
        return True

    def abandon_write(self) -> None:
        """The source is gone: wait for the running write without confirming it (the next core
        starts at the confirmed position, and the targets' versions skip what it made durable)."""
        if self._writing is not None:
            future, _ = self._writing
            self._writing = None
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the source error that ended the session is the one to report
                pass

    def idle_position(self, wal_end: int) -> int | None:
        """Where an idle source may move to (the idle-advance policy), or None when it is not idle."""
        if self.pending or self._writing is not None or self.assembler.unfinished() \
                or wal_end - self.confirmed < max(self.idle_advance_bytes, 1):
            return None
        return wal_end

    def advance_idle(self, wal_end: int) -> bool:
        position = self.idle_position(wal_end)
        return position is not None and self.confirm_up_to(position)
