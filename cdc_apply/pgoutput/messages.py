"""One small immutable type per pgoutput message (PostgreSQL 15 and 18 message formats).

Conventions: LSNs are ints (``*_lsn``), timestamps are microseconds since the PostgreSQL epoch
(``*_ts``, see ``cdc_apply.lsn``), xids and OIDs are unsigned ints. ``xid`` on a DML, Relation,
Type or Message message is set only inside a streamed transaction (protocol 2+), else None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# TupleData column kinds, as the bytes the server sends.
KIND_NULL = ord("n")
KIND_UNCHANGED_TOAST = ord("u")
KIND_TEXT = ord("t")
KIND_BINARY = ord("b")

REPLICA_IDENTITY_NAMES = {"d": "default", "n": "nothing", "f": "full", "i": "index"}


@dataclass(frozen=True, slots=True)
class TupleData:
    """One row image. ``kinds[i]`` is n/u/t/b; ``values[i]`` is the raw bytes (None for n and u)."""

    kinds: bytes
    values: tuple[bytes | None, ...]

    def __len__(self) -> int:
        return len(self.kinds)

    def unchanged_columns(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind == KIND_UNCHANGED_TOAST)


@dataclass(frozen=True, slots=True)
class Message:
    tag: ClassVar[str]


@dataclass(frozen=True, slots=True)
class Begin(Message):
    tag: ClassVar[str] = "B"
    final_lsn: int
    commit_ts: int
    xid: int


@dataclass(frozen=True, slots=True)
class Commit(Message):
    tag: ClassVar[str] = "C"
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin(Message):
    tag: ClassVar[str] = "O"
    origin_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class LogicalMessage(Message):
    tag: ClassVar[str] = "M"
    xid: int | None
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class RelationColumn:
    flags: int
    name: str
    type_oid: int
    typmod: int

    @property
    def is_key(self) -> bool:
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class Relation(Message):
    tag: ClassVar[str] = "R"
    xid: int | None
    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(col.name for col in self.columns if col.is_key)


@dataclass(frozen=True, slots=True)
class Type(Message):
    tag: ClassVar[str] = "Y"
    xid: int | None
    oid: int
    namespace: str
    name: str
    # Not on the wire: the source catalog's facts about the type (JSON, cdc_apply/pgtypes/user.py),
    # attached by the assembler from the live catalog or the capture's row; binary mode needs them.
    facts: str | None = None


@dataclass(frozen=True, slots=True)
class Insert(Message):
    tag: ClassVar[str] = "I"
    xid: int | None
    relation_oid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update(Message):
    tag: ClassVar[str] = "U"
    xid: int | None
    relation_oid: int
    old_kind: str | None  # "K" (key image), "O" (full old row) or None
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete(Message):
    tag: ClassVar[str] = "D"
    xid: int | None
    relation_oid: int
    old_kind: str  # "K" or "O"
    old: TupleData


TRUNCATE_CASCADE = 1
TRUNCATE_RESTART_IDENTITY = 2


@dataclass(frozen=True, slots=True)
class Truncate(Message):
    tag: ClassVar[str] = "T"
    xid: int | None
    options: int
    relation_oids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StreamStart(Message):
    tag: ClassVar[str] = "S"
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop(Message):
    tag: ClassVar[str] = "E"


@dataclass(frozen=True, slots=True)
class StreamCommit(Message):
    tag: ClassVar[str] = "c"
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort(Message):
    """``abort_lsn``/``abort_ts`` come only with protocol 4 (streaming=parallel); found by length."""

    tag: ClassVar[str] = "A"
    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_ts: int | None = None

    @property
    def aborts_whole_transaction(self) -> bool:
        return self.xid == self.subxid


@dataclass(frozen=True, slots=True)
class BeginPrepare(Message):
    tag: ClassVar[str] = "b"
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare(Message):
    tag: ClassVar[str] = "P"
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare(Message):
    tag: ClassVar[str] = "p"
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared(Message):
    tag: ClassVar[str] = "K"
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared(Message):
    tag: ClassVar[str] = "r"
    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str


DML_MESSAGES = (Insert, Update, Delete, Truncate)
