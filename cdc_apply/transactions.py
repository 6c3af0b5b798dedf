"""What assembly yields: a change (its message bytes and the Relation in force), a committed
transaction, a non-transactional message, a transaction's changes past ``spill_bytes`` kept in a
spill file (``ChangeBuffer`` while it is open, ``SpilledChanges`` once committed), and the changes
of a run of plain transactions kept as columns over the read's bytes (``RunColumns``, a transaction's
share of them ``RunChanges``). The assembler
(``assemble.py``) makes them; every runner, the change rows and the apply take them.
"""

from __future__ import annotations

import pickle
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, overload

import numpy as np

from cdc_apply.errors import DecodeError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import PgOutputDecoder

DEFAULT_SPILL_BYTES = 64 * 1024 * 1024
SPILL_RECORD_BYTES = 4 * 1024 * 1024  # changes per pickle in a spill file: what a reader unpickles at once
# What a change costs in memory besides its message bytes (measured: about 230 bytes for a Delete).
# Budgets and pieces count it, so that a transaction of small messages (a mass DELETE: about 30 bytes
# a change) is not held as 8x its messages' size.
CHANGE_MEMORY_BYTES = 256


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x, paid per row change
class Change:
    """One row change. ``relation`` is the definition in force when the change was decoded.

    A change read from the stream keeps its message bytes (``wire``) and leaves its row images
    undecoded: ``changerows/segments.py`` parses and converts them a whole table column at a time, which is
    what keeps decoding ahead of the walsender. ``images()`` decodes one change on its own.
    """

    seq: int
    op: str  # I, U, D or T
    relation: m.Relation
    key: m.TupleData | None = None  # the 'K' image (replica identity columns only)
    old: m.TupleData | None = None  # the 'O' image (REPLICA IDENTITY FULL)
    new: m.TupleData | None = None
    truncate_options: int = 0
    subxid: int | None = None  # the (sub)transaction that made it, inside streamed transactions
    lsn: int = 0  # LSN of the message (the SQL interface gives the transaction's start LSN here)
    wire: bytes | None = None  # the Insert/Update/Delete message, images not yet decoded
    in_stream: bool = False  # ``wire`` carries a streamed transaction's xid after its tag
    source: str | None = None  # capture file and line, for error messages

    def images(self) -> tuple[m.TupleData | None, m.TupleData | None, m.TupleData | None]:
        """(key, old, new), decoding ``wire`` if the images were left undecoded."""
        if self.wire is None:
            return self.key, self.old, self.new
        try:
            message = PgOutputDecoder(self.in_stream).decode(self.wire)
        except DecodeError as exc:
            raise exc.located(lsn=format_lsn(self.lsn), source=self.source) from None
        if isinstance(message, m.Insert):
            return None, None, message.new
        if isinstance(message, (m.Update, m.Delete)):
            old = message.old
            new = message.new if isinstance(message, m.Update) else None
            return (old if message.old_kind == "K" else None), (old if message.old_kind == "O" else None), new
        raise DecodeError(f"change message became {type(message).__name__}", lsn=format_lsn(self.lsn),
                          source=self.source)


class ChangesMadeOnDemand(Sequence[Change]):
    """A sequence of changes that makes its ``Change`` objects the first time it is indexed or
    iterated (``_changes``, which a subclass defines and keeps), and knows its length without them."""

    def _changes(self) -> list[Change]:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> Change: ...
    @overload
    def __getitem__(self, index: slice) -> list[Change]: ...
    def __getitem__(self, index: int | slice) -> Change | list[Change]:
        return self._changes()[index]

    def __iter__(self) -> Iterator[Change]:
        return iter(self._changes())


class SpilledChanges(ChangesMadeOnDemand):
    """The changes of a transaction that spilled to disk, all of them in its spill file, read back
    on demand.

    As a ``Sequence`` it reads them all back the first time it is indexed or iterated, and keeps
    them: every consumer sees the changes as a list would give them. ``pieces()`` reads them back
    a piece at a time instead and keeps none, so a consumer that can work piece by piece holds one
    piece and one spill record (``SPILL_RECORD_BYTES``) at a time (``apply/batch.py``, the append
    of a large transaction in pieces). ``len()``, ``ops`` and ``relations`` need no read-back: the
    buffer counted them as the changes arrived (``ops`` and ``relations`` may include those of
    aborted subtransactions, never miss one).
    """

    def __init__(self, spill_file: IO[bytes], aborted_subxids: frozenset[int], count: int,
                 ops: frozenset[str], relations: dict[int, m.Relation]) -> None:
        self._spill_file = spill_file
        self._aborted = aborted_subxids
        self._count = count
        self._all: list[Change] | None = None
        self.ops = ops
        self.relations: tuple[m.Relation, ...] = tuple(relations.values())

    def pieces(self, max_bytes: int) -> Iterator[list[Change]]:
        """The surviving changes in order, in pieces of at most ``max_bytes`` (see ``_pieces``)."""
        return _pieces((change for record in self._records() for change in record), max_bytes)

    def _records(self) -> Iterator[list[Change]]:
        if self._all is not None:
            yield self._all
            return
        self._spill_file.seek(0)
        while True:
            try:
                record: list[Change] = pickle.load(self._spill_file)
            except EOFError:
                return
            yield [c for c in record if c.subxid not in self._aborted] if self._aborted else record

    def _changes(self) -> list[Change]:
        if self._all is None:
            self._all = [change for record in self._records() for change in record]
            self._spill_file.close()
        return self._all

    def __len__(self) -> int:
        return self._count



_OP_NAMES = [chr(code) for code in range(256)]


@dataclass(eq=False)
class RunColumns:
    """The row changes of a run of plain transactions (``assemble_runs.plain_run``) as columns over
    the read's joined bytes: no ``Change`` and no ``bytes`` per row until a consumer asks for them.
    Row ``i``'s message is ``data[starts[i]:ends[i]]``; ``relations[relation_at[i]]`` is the
    definition in force (one per table in a run: a Relation message ends a run)."""

    data: bytes
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    ops: np.ndarray  # uint8: the row's tag, I, U or D
    seqs: np.ndarray  # int64: its place in its transaction
    lsns: np.ndarray  # int64
    relation_at: np.ndarray  # intp, into ``relations``
    relations: list[m.Relation]
    source: str | None
    _all: list[Change] | None = None

    def changes(self, first: int = 0, stop: int | None = None) -> list[Change]:
        """Rows ``first`` to ``stop`` as ``Change`` objects, made anew."""
        data, relations, source = self.data, self.relations, self.source
        window = slice(first, stop)
        return [Change(seq, _OP_NAMES[op], relations[relation], None, None, None, 0, None, lsn, data[start:end],
                       False, source)
                for seq, op, relation, lsn, start, end in zip(
                    self.seqs[window].tolist(), self.ops[window].tolist(), self.relation_at[window].tolist(),
                    self.lsns[window].tolist(), self.starts[window].tolist(), self.ends[window].tolist(), strict=True)]

    def all_changes(self) -> list[Change]:
        """Every row as a ``Change``, made once: a consumer without a columnar path sees one object per row."""
        if self._all is None:
            self._all = self.changes()
        return self._all


class RunChanges(Sequence[Change]):
    """A committed transaction's changes as rows ``start`` to ``stop`` of a ``RunColumns``. Indexed or
    iterated, it gives the run's ``Change`` objects (made once per run); the change rows read its
    columns instead (``changerows/segments.py``). Equal to any sequence of the same changes; pickled
    as a list."""

    __slots__ = ("run", "start", "stop")

    def __init__(self, run: RunColumns, start: int, stop: int) -> None:
        self.run, self.start, self.stop = run, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, index: int) -> Change: ...
    @overload
    def __getitem__(self, index: slice) -> list[Change]: ...
    def __getitem__(self, index: int | slice) -> Change | list[Change]:
        if isinstance(index, slice):
            return self.run.all_changes()[self.start:self.stop][index]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(index)
        return self.run.all_changes()[self.start + position]

    def __iter__(self) -> Iterator[Change]:
        every = self.run.all_changes()
        return (every[row] for row in range(self.start, self.stop))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)

    def __repr__(self) -> str:
        return f"RunChanges({list(self)!r})"

    def made(self) -> list[Change]:
        """The changes as a list of their own (for a buffer that holds them past the run)."""
        return self.run.changes(self.start, self.stop)

    def relation_oids(self) -> set[int]:
        run = self.run
        if len(run.relations) == 1:
            return {run.relations[0].oid}
        return {run.relations[i].oid for i in set(run.relation_at[self.start:self.stop].tolist())}


def _pieces(changes: Iterable[Change], max_bytes: int) -> Iterator[list[Change]]:
    """``changes`` in order, in lists of at most ``max_bytes`` (at least one change each), a change
    counted as its message bytes and ``CHANGE_MEMORY_BYTES``."""
    piece: list[Change] = []
    size = 0
    for change in changes:
        length = CHANGE_MEMORY_BYTES + (len(change.wire) if change.wire is not None else 0)
        if piece and size + length > max_bytes:
            yield piece
            piece, size = [], 0
        piece.append(change)
        size += length
    if piece:
        yield piece


@dataclass
class Transaction:
    """A committed transaction, ready to apply."""

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int  # microseconds since the PostgreSQL epoch
    changes: list[Change] | SpilledChanges | RunChanges  # a Sequence each way; see those classes
    origin: str | None = None
    origin_lsn: int | None = None
    gid: str | None = None
    kind: str = "plain"  # plain, streamed or prepared
    messages: list[m.LogicalMessage] = field(default_factory=list)
    relations: list[m.Relation] = field(default_factory=list)  # Relation messages seen inside it
    types: list[m.Type] = field(default_factory=list)
    spilled_changes: int = 0  # changes that went through the spill file (aborted subtransactions included)

    def relation_oids(self) -> set[int]:
        """The tables the transaction changed, without reading spilled changes back (for a spilled
        one, also a table only a rolled-back subtransaction changed)."""
        if isinstance(self.changes, SpilledChanges):
            return {relation.oid for relation in self.changes.relations}
        if isinstance(self.changes, RunChanges):
            return self.changes.relation_oids()
        return {change.relation.oid for change in self.changes}


@dataclass(frozen=True, slots=True)
class NonTransactionalMessage:
    lsn: int
    message: m.LogicalMessage


Event = Transaction | NonTransactionalMessage


class ChangeBuffer:
    """Changes of one open transaction; spills to a temp file past a byte budget."""

    def __init__(self, spill_bytes: int, spill_dir: str | None) -> None:
        self.spill_bytes = spill_bytes
        self.spill_dir = spill_dir
        self.memory: list[Change] = []
        self.memory_bytes = 0
        self.spill_file: IO[bytes] | None = None
        self.spilled_changes = 0
        self.aborted_subxids: set[int] = set()
        self.count = 0
        # What the spilled changes are, known without reading them back (aborted ones included);
        # counted as they spill, so the per-change path of a transaction that never spills pays nothing.
        # Made at the first spill: most transactions never spill, and a Counter costs a microsecond.
        self.spilled_by_subxid: Counter[int | None] | None = None
        self.ops: set[str] = set()
        self.relations: dict[int, m.Relation] = {}  # id(relation) -> the definition

    def append(self, change: Change, size: int) -> None:
        """``change``, whose message is ``size`` bytes."""
        self.memory.append(change)
        self.count += 1
        self.memory_bytes += size + CHANGE_MEMORY_BYTES
        if self.memory_bytes > self.spill_bytes:
            self._spill()

    def extend(self, changes: list[Change], size: int) -> None:
        """``changes`` appended at once, whose messages are ``size`` bytes in all."""
        self.memory.extend(changes)
        self.count += len(changes)
        self.memory_bytes += size + CHANGE_MEMORY_BYTES * len(changes)
        if self.memory_bytes > self.spill_bytes:
            self._spill()

    def _spill(self) -> None:
        if self.spill_file is None:
            self.spill_file = tempfile.TemporaryFile(prefix="cdc_apply_spill_", dir=self.spill_dir)
            self.spilled_by_subxid = Counter()
        for record in _pieces(self.memory, SPILL_RECORD_BYTES):  # records small enough to read back one at a time
            pickle.dump(record, self.spill_file, protocol=pickle.HIGHEST_PROTOCOL)
        assert self.spilled_by_subxid is not None
        self.spilled_by_subxid.update(change.subxid for change in self.memory)
        self.ops.update(change.op for change in self.memory)
        self.relations.update((id(change.relation), change.relation) for change in self.memory)
        self.spilled_changes += len(self.memory)
        self.memory = []
        self.memory_bytes = 0

    @property
    def spilled(self) -> bool:
        return self.spill_file is not None

    def abort_subtransaction(self, subxid: int) -> None:
        self.aborted_subxids.add(subxid)
        self.memory = [c for c in self.memory if c.subxid != subxid]

    def finish(self) -> list[Change] | SpilledChanges:
        """The surviving changes in order: a list when none spilled, else a ``SpilledChanges`` that
        owns the spill file (the changes still in memory spilled too) and reads it back only when asked."""
        if self.spill_file is None:
            changes, self.memory = self.memory, []
            return changes
        if self.memory:
            self._spill()
        assert self.spilled_by_subxid is not None
        aborted = sum(self.spilled_by_subxid[subxid] for subxid in self.aborted_subxids)
        changes = SpilledChanges(self.spill_file, frozenset(self.aborted_subxids), self.spilled_changes - aborted,
                                 frozenset(self.ops), self.relations)
        self.spill_file, self.memory = None, []
        return changes

    def discard(self) -> None:
        if self.spill_file is not None:
            self.spill_file.close()
            self.spill_file = None
        self.memory = []
