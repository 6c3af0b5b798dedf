"""A large batch's change log files written by a helper process (docs/changelog.md, "Who writes the files").

The stream's thread receives, decodes and assembles on the driver's one GIL, and building a batch's
log rows and writing them costs about as much again per change: while a backlog is worked through,
the two took turns on one core (``bench e2e --changelog``). A batch of at least
``changelog.process_min_changes`` changes held in memory is therefore handed to one helper process,
packed into a few arrays and buffers (``PackedTransactions``: no Python object per change crosses),
which builds the same rows (``spark/rows.record_batches``) and writes the same files
(``spark/log_files.write_partitions``); the writer thread waits without the GIL, so the stream's
thread goes on receiving. A smaller batch is written on the writer thread: the hand-over costs more
than it saves there. The driver commits the files as before, so exactly-once and the order of
commits are unchanged.

Invariant: the helper only writes files that no commit names yet; if it dies, or the driver does,
the files are in no commit (``VACUUM`` removes them), and the driver's error names the batch.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, BinaryIO

import numpy as np

from cdc_apply.apply.files import WrittenFile
from cdc_apply.assemble import Change, SpilledChanges, Transaction
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m

_SEQ, _OP, _RELATION, _LSN = attrgetter("seq"), attrgetter("op"), attrgetter("relation"), attrgetter("lsn")
_WIRE, _IN_STREAM, _TRUNCATE_OPTIONS, _SOURCE = (attrgetter("wire"), attrgetter("in_stream"),
                                                 attrgetter("truncate_options"), attrgetter("source"))


@dataclass(frozen=True)
class PackedTransactions:
    """Committed transactions held in memory, as arrays: what their change log rows are built from."""

    xids: np.ndarray  # per transaction
    commit_lsns: np.ndarray
    end_lsns: np.ndarray
    commit_ts: np.ndarray
    origins: list[str | None]
    types: list[list[m.Type]]
    change_counts: np.ndarray
    seqs: np.ndarray  # per change
    ops: bytes
    lsns: np.ndarray
    relation_index: np.ndarray  # into ``relations``: the Relation in force for each change
    relations: list[m.Relation]
    wire_lengths: np.ndarray  # -1: no message (a Truncate)
    wires: bytes
    in_stream: np.ndarray
    truncate_options: np.ndarray
    sources: list[str | None] | None  # None: no change names a source


def pack(transactions: Sequence[Transaction]) -> PackedTransactions | None:
    """The transactions as arrays; None when a change cannot be rebuilt from them (a row change
    decoded without its message, or a spilled transaction)."""
    if any(isinstance(t.changes, SpilledChanges) for t in transactions):
        return None
    changes: list[Change] = list(chain.from_iterable(t.changes for t in transactions))  # type: ignore[arg-type]
    count = len(changes)
    ops = "".join(map(_OP, changes))
    wires = list(map(_WIRE, changes))
    truncates = ops.count("T")
    if wires.count(None) != truncates:
        return None
    if truncates:
        lengths = np.fromiter((-1 if wire is None else len(wire) for wire in wires), np.int64, count)
        joined = b"".join(wire for wire in wires if wire is not None)
    else:
        lengths = np.fromiter(map(len, wires), np.int64, count)
        joined = b"".join(wires)
    relation_ids = np.fromiter(map(id, map(_RELATION, changes)), np.int64, count)
    distinct, first, relation_index = np.unique(relation_ids, return_index=True, return_inverse=True)
    sources = list(map(_SOURCE, changes))
    return PackedTransactions(
        xids=np.fromiter((t.xid for t in transactions), np.int64, len(transactions)),
        commit_lsns=np.fromiter((t.commit_lsn for t in transactions), np.int64, len(transactions)),
        end_lsns=np.fromiter((t.end_lsn for t in transactions), np.int64, len(transactions)),
        commit_ts=np.fromiter((t.commit_ts for t in transactions), np.int64, len(transactions)),
        origins=[t.origin for t in transactions],
        types=[t.types for t in transactions],
        change_counts=np.fromiter((len(t.changes) for t in transactions), np.int64, len(transactions)),
        seqs=np.fromiter(map(_SEQ, changes), np.int64, count),
        ops=ops.encode(),
        lsns=np.fromiter(map(_LSN, changes), np.int64, count),
        relation_index=relation_index.astype(np.int32),
        relations=[changes[i].relation for i in first.tolist()] if len(distinct) else [],
        wire_lengths=lengths,
        wires=joined,
        in_stream=np.fromiter(map(_IN_STREAM, changes), bool, count),
        truncate_options=np.fromiter(map(_TRUNCATE_OPTIONS, changes), np.int8, count),
        sources=sources if any(sources) else None,
    )


def unpack(packed: PackedTransactions) -> list[Transaction]:
    """The transactions again, their changes undecoded as the stream's (``Change.wire``)."""
    ends = np.cumsum(np.maximum(packed.wire_lengths, 0))
    starts = (ends - np.maximum(packed.wire_lengths, 0)).tolist()
    ends_list = ends.tolist()
    wires = packed.wires
    relations = [packed.relations[i] for i in packed.relation_index.tolist()]
    has_wire = (packed.wire_lengths >= 0).tolist()
    sources = packed.sources or [None] * len(relations)
    changes = [Change(seq, op, relation, None, None, None, options, None, lsn,
                      wires[start:end] if wired else None, in_stream, source)
               for seq, op, relation, options, lsn, start, end, wired, in_stream, source in zip(
                   packed.seqs.tolist(), packed.ops.decode(), relations, packed.truncate_options.tolist(),
                   packed.lsns.tolist(), starts, ends_list, has_wire, packed.in_stream.tolist(), sources)]
    transactions = []
    at = 0
    for xid, commit_lsn, end_lsn, commit_ts, origin, types, count in zip(
            packed.xids.tolist(), packed.commit_lsns.tolist(), packed.end_lsns.tolist(), packed.commit_ts.tolist(),
            packed.origins, packed.types, packed.change_counts.tolist()):
        transactions.append(Transaction(xid, commit_lsn, end_lsn, commit_ts, changes[at:at + count], origin,
                                        types=types))
        at += count
    return transactions


def _write_in_helper(root: str, packed: PackedTransactions) -> list[WrittenFile] | str:
    """In the helper process: the transactions' log files; a bad change's error as text."""
    from cdc_apply.spark.log_files import write_partitions
    from cdc_apply.spark.rows import record_batches

    try:
        return write_partitions(root, record_batches(unpack(packed)))
    except CdcApplyError as exc:  # its own type may not survive pickling; its message names the change
        return str(exc)


_LENGTH = struct.Struct("!Q")
_BATCH_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where there is one


def _send(stream: BinaryIO, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    """The next value, or EOFError when the other side has gone."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError
    return pickle.loads(data)


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """The helper's loop: (root, the file holding the packed transactions) in, the files (or an
    error's text) out, until the driver closes its end (or dies: the read ends, and so does the
    helper)."""
    while True:
        try:
            root, batch_file = _receive(requests)
        except EOFError:
            return
        with open(batch_file, "rb") as handle:
            packed = pickle.load(handle)
        os.unlink(batch_file)
        _send(replies, _write_in_helper(root, packed))


class LogWriterProcess:
    """The one helper process of a driver, started when first needed and kept for its life. A plain
    child process (``python -m cdc_apply.changelog_process``): multiprocessing's spawn would run the
    driver's own script again in it when that script has no ``__main__`` guard."""

    _lock = threading.Lock()
    _process: subprocess.Popen[bytes] | None = None

    @classmethod
    def write(cls, root: str, transactions: Sequence[Transaction]) -> list[WrittenFile] | None:
        """The transactions' log files under ``root``, written by the helper; None when they
        cannot be packed (the caller writes them itself). One batch at a time."""
        packed = pack(transactions)
        if packed is None:
            return None
        with cls._lock:
            if cls._process is None or cls._process.poll() is not None:
                cls._process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE)
            process = cls._process
            try:
                # One write of the whole batch to a file, and its name through the pipe: a pipe takes
                # 64 KiB per write, and each write gives the GIL to the stream's thread, which holds
                # it up to its switch interval (5 ms) before this thread gets it back.
                handle, batch_file = tempfile.mkstemp(prefix="cdc_apply_log_batch_", dir=_BATCH_DIR)
                with os.fdopen(handle, "wb") as out:
                    out.write(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))
                _send(process.stdin, (root, batch_file))  # type: ignore[arg-type]
                result = _receive(process.stdout)  # type: ignore[arg-type]
            except (EOFError, OSError) as exc:
                process.kill()
                cls._process = None
                raise CdcApplyError(
                    f"the change log's writer process ended (exit code {process.wait()}) while writing the batch of "
                    f"{len(transactions)} transactions at LSN {format_lsn(transactions[0].commit_lsn)}.."
                    f"{format_lsn(transactions[-1].commit_lsn)} ({type(exc).__name__}); none of it was "
                    "committed") from None
        if isinstance(result, str):
            raise CdcApplyError(result)
        return result


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the replies
    sys.stdout = sys.stderr
    serve(sys.stdin.buffer, replies)
