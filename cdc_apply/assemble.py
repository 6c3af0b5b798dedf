"""Typed messages -> committed transactions, in commit order.

Invariants (checked by tests/test_assemble*.py):
- Only committed work is emitted: a Begin..Commit transaction at its Commit, a streamed one at
  Stream Commit, a prepared one at Commit Prepared. Stream Abort of the top xid drops the whole
  transaction; Stream Abort of a subxid drops only the changes that subtransaction made;
  Rollback Prepared drops the prepared transaction.
- Transactions come out in the order their commit messages arrive, which is commit-LSN order.
- Every change carries the Relation definition in force when it was decoded, so a mid-stream
  ALTER TABLE never reinterprets earlier changes.
- A change for a relation OID with no earlier Relation message is an error, never skipped.
- Streamed and prepared transactions buffer at most ``spill_bytes`` of changes in memory; the
  rest goes to a temporary file. An aborted transaction's file is removed at once; a committed
  one's travels with it (``SpilledChanges``) and is read back when applied, in pieces where the
  consumer can take them so, and removed when the transaction is released.
- Transactional logical messages travel with their transaction; non-transactional ones are
  emitted at once.
- ``safe_confirm_lsn`` never passes the start of a transaction that is still open or prepared,
  so a restart from the confirmed position sees it again in full.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cdc_apply.assemble_runs import PLAIN_TAGS, PlainRun, plain_run
from cdc_apply.errors import AssemblyError, DecodeError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import ROW_MARKERS, PgOutputDecoder, relation_oid_offset, row_marker_offset
from cdc_apply.pgoutput.framing import MessageSpans
from cdc_apply.sources.raw import RawMessage
# What the assembler yields is in transactions.py; imported from here too, the path before it.
from cdc_apply.transactions import (  # noqa: F401
    DEFAULT_SPILL_BYTES, Change, ChangeBuffer, Event, NonTransactionalMessage, SpilledChanges, Transaction,
)

log = logging.getLogger(__name__)

TypeFactsLookup = Callable[[int], "str | None"]  # type OID -> the source catalog's facts (pgtypes/user.py)

_UINT32 = struct.Struct("!I")
_ROW_MARKERS = {tag: markers.encode() for tag, markers in ROW_MARKERS.items()}
_ROW_TAGS = frozenset(_ROW_MARKERS)
_OPS = {tag: chr(tag) for tag in _ROW_MARKERS}
_MARKER_AT = {in_stream: row_marker_offset(in_stream) for in_stream in (False, True)}
_RELATION_AT = {in_stream: relation_oid_offset(in_stream) for in_stream in (False, True)}
# A run of plain transactions shorter than this is taken message by message: numpy's fixed cost per
# call (a few microseconds, some 60 calls a run) outweighs the per-message objects it saves.
MIN_RUN_MESSAGES = 512


@dataclass
class _OpenTransaction:
    xid: int
    first_lsn: int
    buffer: ChangeBuffer
    origin: str | None = None
    origin_lsn: int | None = None
    gid: str | None = None
    kind: str = "plain"
    messages: list[m.LogicalMessage] = field(default_factory=list)
    relations: list[m.Relation] = field(default_factory=list)
    types: list[m.Type] = field(default_factory=list)
    prepare_ts: int = 0

    def finish(self, commit_lsn: int, end_lsn: int, commit_ts: int) -> Transaction:
        changes = self.buffer.finish()
        return Transaction(self.xid, commit_lsn, end_lsn, commit_ts, changes, self.origin,
                           self.origin_lsn, self.gid, self.kind, self.messages, self.relations, self.types,
                           self.buffer.spilled_changes)


class Assembler:
    """Feeds raw messages in stream order; returns the events each one completes.

    One Assembler lives as long as its source connection: its relation cache, open streamed
    transactions and prepared transactions carry over from one batch to the next.
    """

    def __init__(self, *, spill_bytes: int = DEFAULT_SPILL_BYTES, spill_dir: str | Path | None = None,
                 skip_origins: Iterable[str] = (), in_stream: bool = False,
                 type_facts: TypeFactsLookup | None = None, min_run_messages: int = MIN_RUN_MESSAGES) -> None:
        """``type_facts``: the live source catalog's facts about a type OID a Type message names (JSON,
        ``pgtypes/user.py``); a capture's row carries them instead (``RawMessage.type_facts``).
        ``min_run_messages``: the shortest run ``feed_spans`` takes a run at a time."""
        self.min_run_messages = min_run_messages
        self.decoder = PgOutputDecoder(in_stream)
        self.type_facts = type_facts
        self.relations: dict[int, m.Relation] = {}
        self.types: dict[int, m.Type] = {}
        self.spill_bytes = spill_bytes
        self.spill_dir = str(spill_dir) if spill_dir is not None else None
        self.skip_origins = frozenset(skip_origins)
        self._current: _OpenTransaction | None = None  # inside Begin..Commit or Begin Prepare..Prepare
        self._streamed: dict[int, _OpenTransaction] = {}  # top xid -> open streamed transaction
        self._stream_xid: int | None = None  # the streamed transaction of the open Stream Start block
        self._prepared: dict[str, _OpenTransaction] = {}  # gid -> prepared, awaiting its outcome
        self.last_lsn = 0

    # -- public API --------------------------------------------------------------------------

    def feed(self, raw: RawMessage) -> list[Event]:
        data = raw.data
        if data and data[0] in _ROW_TAGS and self._feed_row_change(raw):
            return []
        try:
            message = self.decoder.decode(data)
            self.last_lsn = max(self.last_lsn, raw.lsn)
            return self._handle(message, raw)
        except DecodeError as exc:
            raise exc.located(lsn=format_lsn(raw.lsn), source=raw.source) from None
        except AssemblyError as exc:
            where = ", ".join(p for p in (raw.source, f"LSN {format_lsn(raw.lsn)}") if p)
            raise AssemblyError(f"{where}: {exc}") from None

    def _feed_row_change(self, raw: RawMessage) -> bool:
        """Insert/Update/Delete without decoding their row images; False when the header is not
        well formed, so the full decoder raises the exact error."""
        data = raw.data
        in_stream = self.decoder.in_stream
        head = _MARKER_AT[in_stream]
        if len(data) < head + 3 or data[head] not in _ROW_MARKERS[data[0]]:
            return False
        xid = _UINT32.unpack_from(data, 1)[0] if in_stream else None  # the stream xid follows the tag
        relation = self.relations.get(_UINT32.unpack_from(data, _RELATION_AT[in_stream])[0])
        txn = self._current if self._stream_xid is None else self._streamed[self._stream_xid]
        if relation is None or txn is None:
            return False  # the full path raises the located error
        lsn = raw.lsn
        if lsn > self.last_lsn:
            self.last_lsn = lsn
        buffer = txn.buffer
        buffer.append(Change(buffer.count, _OPS[data[0]], relation, None, None, None, 0, xid, lsn, data, in_stream,
                             raw.source), len(data))
        return True

    def events(self, raws: Iterable[RawMessage]) -> Iterator[Event]:
        row_change = self._feed_row_change
        for raw in raws:
            data = raw.data
            if data and data[0] in _ROW_TAGS and row_change(raw):
                continue  # most messages: one row change, no event
            yield from self.feed(raw)

    def feed_spans(self, spans: MessageSpans, source: str | None = None) -> Iterator[Event]:
        """Messages received together (a walsender read): runs of plain transactions are taken a
        run at a time (``assemble_runs.plain_run``), every other message, and a run it declines,
        message by message. The same events as ``events`` of the same messages, in order."""
        count = len(spans)
        if count < self.min_run_messages:
            yield from self._feed_each(spans, 0, count, source)
            return
        buf = np.frombuffer(spans.data, np.uint8)
        tags = np.where(spans.ends > spans.starts, buf[np.minimum(spans.starts, max(len(buf) - 1, 0))], 0) \
            if len(buf) else np.zeros(count, np.uint8)
        run_start = 0
        for other in [*np.flatnonzero(~PLAIN_TAGS[tags]).tolist(), count]:
            if other > run_start:
                yield from self._feed_run(spans, run_start, other, source)
            if other < count:
                yield from self._feed_each(spans, other, other + 1, source)
            run_start = other + 1

    def _feed_run(self, spans: MessageSpans, first: int, stop: int, source: str | None) -> Iterator[Event]:
        current = self._current
        run = None
        if stop - first >= self.min_run_messages and self._stream_xid is None and (current is None or current.kind == "plain"):
            run = plain_run(spans, first, stop, None if current is None else current.buffer.count, self.relations,
                            source)
        if run is None:
            yield from self._feed_each(spans, first, stop, source)
        else:
            yield from self._take_run(run)

    def _feed_each(self, spans: MessageSpans, first: int, stop: int, source: str | None) -> Iterator[Event]:
        yield from self.events(RawMessage(lsn, None, spans.data[start:end], source) for start, end, lsn in zip(
            spans.starts[first:stop].tolist(), spans.ends[first:stop].tolist(), spans.lsns[first:stop].tolist(),
            strict=True))

    def _take_run(self, run: PlainRun) -> list[Event]:
        events: list[Event] = []
        if run.leading or run.leading_commit is not None:
            assert self._current is not None
            self._current.buffer.extend(run.leading, run.leading_size)
            if run.leading_commit is not None:
                txn, self._current = self._current, None
                events.extend(self._emit(txn.finish(*run.leading_commit)))
        for begun in run.transactions:
            committed = begun.held_whole(self.spill_bytes)
            if committed is None:
                txn = self._new_transaction(begun.xid, begun.first_lsn, "plain")
                txn.buffer.extend(begun.changes.made(), begun.size)
                if begun.commit is None:
                    self._current = txn
                    continue
                committed = txn.finish(*begun.commit)
            events.extend(self._emit(committed))
        self.last_lsn = max(self.last_lsn, run.last_lsn)
        return events

    def transactions(self, raws: Iterable[RawMessage]) -> Iterator[Transaction]:
        for event in self.events(raws):
            if isinstance(event, Transaction):
                yield event

    def pending_prepared(self) -> list[str]:
        return sorted(self._prepared)

    def open_streamed(self) -> list[int]:
        return sorted(self._streamed)

    def _in_flight(self) -> list[_OpenTransaction]:
        """Every transaction begun but neither committed nor aborted."""
        return [*self._streamed.values(), *self._prepared.values(), *([] if self._current is None else [self._current])]

    def safe_confirm_lsn(self, processed_lsn: int) -> int:
        """The highest LSN a slot may be confirmed to: not past any transaction still in flight."""
        return min([processed_lsn, *(txn.first_lsn for txn in self._in_flight())])

    def unfinished(self) -> list[tuple[int, int, str]]:
        """(xid, first LSN, kind) of every transaction in flight."""
        return [(txn.xid, txn.first_lsn, txn.kind) for txn in self._in_flight()]

    def warn_unfinished(self, what: str) -> None:
        """At the end of a finite input (a capture): say which transactions it cut off, and dropped."""
        for xid, first_lsn, kind in self.unfinished():
            log.warning("%s ends inside %s transaction %d (begun at LSN %s): its changes are not applied",
                        what, kind, xid, format_lsn(first_lsn))

    def close(self) -> None:
        for txn in self._in_flight():
            txn.buffer.discard()

    # -- message handling --------------------------------------------------------------------

    def _new_transaction(self, xid: int, lsn: int, kind: str) -> _OpenTransaction:
        return _OpenTransaction(xid, lsn, ChangeBuffer(self.spill_bytes, self.spill_dir), kind=kind)

    def _open_for_change(self, xid: int | None) -> _OpenTransaction:
        if self._stream_xid is not None:
            return self._streamed[self._stream_xid]
        if self._current is None:
            raise AssemblyError("a change arrived outside any transaction")
        return self._current

    def _handle(self, msg: m.Message, raw: RawMessage) -> list[Event]:
        handler = _HANDLERS.get(type(msg))
        if handler is None:  # pragma: no cover - every decoded type has a handler
            raise AssemblyError(f"no handler for {type(msg).__name__}")
        return handler(self, msg, raw)

    def _on_begin(self, msg: m.Begin, raw: RawMessage) -> list[Event]:
        self._require_idle("Begin")
        self._current = self._new_transaction(msg.xid, raw.lsn, "plain")
        return []

    def _on_begin_prepare(self, msg: m.BeginPrepare, raw: RawMessage) -> list[Event]:
        self._require_idle("Begin Prepare")
        self._current = self._new_transaction(msg.xid, raw.lsn, "prepared")
        self._current.gid = msg.gid
        return []

    def _require_idle(self, what: str) -> None:
        if self._current is not None:
            raise AssemblyError(f"{what} while transaction {self._current.xid} is still open")
        if self._stream_xid is not None:
            raise AssemblyError(f"{what} inside the stream block of transaction {self._stream_xid}")

    def _on_commit(self, msg: m.Commit, raw: RawMessage) -> list[Event]:
        txn = self._current
        if txn is None or txn.kind != "plain":
            raise AssemblyError("Commit without a matching Begin")
        self._current = None
        return self._emit(txn.finish(msg.commit_lsn, msg.end_lsn, msg.commit_ts))

    def _on_prepare(self, msg: m.Prepare, raw: RawMessage) -> list[Event]:
        txn = self._current
        if txn is None or txn.kind != "prepared":
            raise AssemblyError("Prepare without a matching Begin Prepare")
        self._current = None
        self._hold_prepared(txn, msg.gid, msg.prepare_ts)
        return []

    def _hold_prepared(self, txn: _OpenTransaction, gid: str, prepare_ts: int) -> None:
        if gid in self._prepared:
            raise AssemblyError(f"prepared transaction {gid!r} is already pending")
        txn.gid = gid
        txn.prepare_ts = prepare_ts
        self._prepared[gid] = txn

    def _on_commit_prepared(self, msg: m.CommitPrepared, raw: RawMessage) -> list[Event]:
        txn = self._prepared.pop(msg.gid, None)
        if txn is None:
            raise AssemblyError(f"Commit Prepared for unknown prepared transaction {msg.gid!r} "
                                "(its Prepare was never received: was the slot confirmed past it?)")
        return self._emit(txn.finish(msg.commit_lsn, msg.end_lsn, msg.commit_ts))

    def _on_rollback_prepared(self, msg: m.RollbackPrepared, raw: RawMessage) -> list[Event]:
        txn = self._prepared.pop(msg.gid, None)
        if txn is not None:
            txn.buffer.discard()
        # A rollback of a transaction never prepared to us (prepared before the slot's two-phase
        # start) has nothing to drop: PostgreSQL sends it all the same.
        return []

    def _on_origin(self, msg: m.Origin, raw: RawMessage) -> list[Event]:
        txn = self._open_for_change(None)
        txn.origin = msg.name
        txn.origin_lsn = msg.origin_lsn
        return []

    def _on_logical_message(self, msg: m.LogicalMessage, raw: RawMessage) -> list[Event]:
        if not msg.transactional:
            return [NonTransactionalMessage(raw.lsn, msg)]
        self._open_for_change(msg.xid).messages.append(msg)
        return []

    def _on_relation(self, msg: m.Relation, raw: RawMessage) -> list[Event]:
        self.relations[msg.oid] = msg
        txn = self._stream_or_current()
        if txn is not None:
            txn.relations.append(msg)
        return []

    def _on_type(self, msg: m.Type, raw: RawMessage) -> list[Event]:
        # Looked up again at every Type message: pgoutput sends one before each Relation message of a
        # table using the type, so a changed type is read afresh with the Relation that follows it.
        facts = raw.type_facts or (self.type_facts(msg.oid) if self.type_facts is not None else None)
        if facts is not None:
            msg = replace(msg, facts=facts)
        self.types[msg.oid] = msg
        txn = self._stream_or_current()
        if txn is not None:
            txn.types.append(msg)
        return []

    def _stream_or_current(self) -> _OpenTransaction | None:
        if self._stream_xid is not None:
            return self._streamed[self._stream_xid]
        return self._current

    def _relation(self, oid: int) -> m.Relation:
        relation = self.relations.get(oid)
        if relation is None:
            raise DecodeError(f"change for unknown relation OID {oid} (no Relation message before it)")
        return relation

    def _on_row_message(self, msg: m.Insert | m.Update | m.Delete, raw: RawMessage) -> list[Event]:
        # Only reached if the header fast path declined a message the decoder accepts.
        txn = self._open_for_change(msg.xid)
        old = None if isinstance(msg, m.Insert) else msg.old
        old_kind = None if isinstance(msg, m.Insert) else msg.old_kind
        new = None if isinstance(msg, m.Delete) else msg.new
        txn.buffer.append(Change(txn.buffer.count, msg.tag, self._relation(msg.relation_oid),
                                 key=old if old_kind == "K" else None, old=old if old_kind == "O" else None,
                                 new=new, subxid=msg.xid, lsn=raw.lsn, source=raw.source), len(raw.data))
        return []

    def _on_truncate(self, msg: m.Truncate, raw: RawMessage) -> list[Event]:
        txn = self._open_for_change(msg.xid)
        for oid in msg.relation_oids:
            txn.buffer.append(Change(txn.buffer.count, "T", self._relation(oid),
                                  truncate_options=msg.options, subxid=msg.xid, lsn=raw.lsn), len(raw.data))
        return []

    def _on_stream_start(self, msg: m.StreamStart, raw: RawMessage) -> list[Event]:
        if self._current is not None:
            raise AssemblyError(f"Stream Start while transaction {self._current.xid} is open")
        txn = self._streamed.get(msg.xid)
        if txn is None:
            txn = _OpenTransaction(msg.xid, raw.lsn, ChangeBuffer(self.spill_bytes, self.spill_dir),
                                   kind="streamed")
            self._streamed[msg.xid] = txn
        self._stream_xid = msg.xid
        return []

    def _on_stream_stop(self, msg: m.StreamStop, raw: RawMessage) -> list[Event]:
        self._stream_xid = None
        return []

    def _take_streamed(self, xid: int, what: str) -> _OpenTransaction:
        if self._stream_xid is not None:
            raise AssemblyError(f"{what} inside an open stream block")
        txn = self._streamed.pop(xid, None)
        if txn is None:
            raise AssemblyError(f"{what} for transaction {xid}, which never streamed")
        return txn

    def _on_stream_commit(self, msg: m.StreamCommit, raw: RawMessage) -> list[Event]:
        txn = self._take_streamed(msg.xid, "Stream Commit")
        return self._emit(txn.finish(msg.commit_lsn, msg.end_lsn, msg.commit_ts))

    def _on_stream_abort(self, msg: m.StreamAbort, raw: RawMessage) -> list[Event]:
        if self._stream_xid is not None:  # the walsender sends it only after Stream Stop
            raise AssemblyError(f"Stream Abort for transaction {msg.xid} inside an open stream block")
        if msg.aborts_whole_transaction:
            txn = self._streamed.pop(msg.xid, None)
            if txn is not None:
                txn.buffer.discard()
            return []
        txn = self._streamed.get(msg.xid)
        if txn is not None:
            txn.buffer.abort_subtransaction(msg.subxid)
        return []

    def _on_stream_prepare(self, msg: m.StreamPrepare, raw: RawMessage) -> list[Event]:
        txn = self._take_streamed(msg.xid, "Stream Prepare")
        txn.kind = "prepared"
        self._hold_prepared(txn, msg.gid, msg.prepare_ts)
        return []

    def _emit(self, txn: Transaction) -> list[Event]:
        if txn.origin is not None and txn.origin in self.skip_origins:
            return []
        return [txn]


_HANDLERS = {
    m.Begin: Assembler._on_begin,
    m.Commit: Assembler._on_commit,
    m.Origin: Assembler._on_origin,
    m.LogicalMessage: Assembler._on_logical_message,
    m.Relation: Assembler._on_relation,
    m.Type: Assembler._on_type,
    m.Insert: Assembler._on_row_message,
    m.Update: Assembler._on_row_message,
    m.Delete: Assembler._on_row_message,
    m.Truncate: Assembler._on_truncate,
    m.StreamStart: Assembler._on_stream_start,
    m.StreamStop: Assembler._on_stream_stop,
    m.StreamCommit: Assembler._on_stream_commit,
    m.StreamAbort: Assembler._on_stream_abort,
    m.BeginPrepare: Assembler._on_begin_prepare,
    m.Prepare: Assembler._on_prepare,
    m.StreamPrepare: Assembler._on_stream_prepare,
    m.CommitPrepared: Assembler._on_commit_prepared,
    m.RollbackPrepared: Assembler._on_rollback_prepared,
}


__all__ = ["Assembler", "Change", "SpilledChanges", "Transaction", "NonTransactionalMessage"]
