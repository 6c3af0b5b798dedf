"""Runs of plain transactions read a whole read at a time, over the read's joined bytes.

Most of what the walsender sends is Begin, Insert/Update/Delete and Commit, outside any stream
block. ``plain_run`` finds those messages' boundaries, headers, transactions and relations with
numpy, once per read: a committed transaction's changes stay columns over the read's bytes
(``RunColumns``, ``RunChanges``), and assembly makes the ``Transaction`` of each commit and no message
object, frame object, ``RawMessage`` or ``Change``.

It declines (returns None) a run it cannot take whole: a message not well formed (a Begin or a
Commit of the wrong length, a row header whose marker is not one its tag allows, a position past
2^63), a Begin inside an open transaction, a Commit or a row outside one, a relation OID with no
Relation message before it. The assembler then takes the run message by message, the path that
raises the exact error, located, or gives the same transactions (tests/test_assemble_runs.py holds
the two paths equal, hostile input included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cdc_apply.bigendian import read_uint
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import ROW_MARKERS, relation_oid_offset, row_marker_offset
from cdc_apply.pgoutput.framing import MessageSpans
from cdc_apply.transactions import CHANGE_MEMORY_BYTES, Change, RunChanges, RunColumns, Transaction

_B, _C, _I, _U, _D = (ord(tag) for tag in "BCIUD")
BEGIN_LENGTH = 1 + 8 + 8 + 4  # tag, final LSN, commit timestamp, xid
COMMIT_LENGTH = 1 + 1 + 8 + 8 + 8  # tag, flags, commit LSN, end LSN, commit timestamp
PLAIN_TAGS = np.zeros(256, bool)
PLAIN_TAGS[[_B, _C, _I, _U, _D]] = True
_MARKER_AT = row_marker_offset(False)
_RELATION_AT = relation_oid_offset(False)
_ROW_HEADER = _MARKER_AT + 3  # the marker and at least a column count: what the per-message path asks too
_ALLOWED = np.zeros((256, 256), bool)  # [tag, first marker]
for _tag, _markers in ROW_MARKERS.items():
    _ALLOWED[_tag, [ord(marker) for marker in _markers]] = True


@dataclass(slots=True)
class RunTransaction:
    """A transaction begun inside the run; ``commit`` is None when it is still open at the run's end."""

    xid: int
    first_lsn: int
    changes: RunChanges
    size: int  # its row messages' bytes
    commit: tuple[int, int, int] | None  # commit LSN, end LSN, commit timestamp

    def held_whole(self, spill_bytes: int) -> Transaction | None:
        """The transaction, when it commits in the run within the spill budget: it needs no buffer."""
        if self.commit is None or self.size + CHANGE_MEMORY_BYTES * len(self.changes) > spill_bytes:
            return None
        return Transaction(self.xid, *self.commit, self.changes)


@dataclass(slots=True)
class PlainRun:
    leading: list[Change]  # rows of the transaction open before the run
    leading_size: int
    leading_commit: tuple[int, int, int] | None  # when that transaction commits in the run
    transactions: list[RunTransaction]
    last_lsn: int


def plain_run(spans: MessageSpans, first: int, stop: int, open_changes: int | None,
              relations: dict[int, m.Relation], source: str | None) -> PlainRun | None:
    """Messages ``first`` to ``stop`` of ``spans``, every one a Begin, Commit, Insert, Update or
    Delete outside a stream block. ``open_changes``: how many changes the plain transaction open
    before the run holds (None: none is open)."""
    starts, ends, lsns = spans.starts[first:stop], spans.ends[first:stop], spans.lsns[first:stop]
    buf = np.frombuffer(spans.data, np.uint8)
    lengths = ends - starts
    tags = buf[starts]
    is_begin, is_commit = tags == _B, tags == _C
    is_row = ~(is_begin | is_commit)
    step = is_begin.astype(np.int64) - is_commit
    depth_before = np.cumsum(step) - step + (open_changes is not None)
    well_formed = np.where(is_begin, (depth_before == 0) & (lengths == BEGIN_LENGTH),
                           np.where(is_commit, (depth_before == 1) & (lengths == COMMIT_LENGTH),
                                    (depth_before == 1) & (lengths >= _ROW_HEADER)))
    if not well_formed.all() or (lsns >= 2 ** 63).any():
        return None
    row_starts = starts[is_row]
    if not _ALLOWED[tags[is_row], buf[row_starts + _MARKER_AT]].all():
        return None
    oids = read_uint(buf, row_starts + _RELATION_AT, 4)
    known = np.unique(oids)
    in_force = [relations.get(oid) for oid in known.tolist()]
    if None in in_force:
        return None
    begin_at, commit_at = starts[is_begin], starts[is_commit]
    final_lsns = read_uint(buf, begin_at + 1, 8)
    commit_lsns, end_lsns = read_uint(buf, commit_at + 2, 8), read_uint(buf, commit_at + 10, 8)
    if (final_lsns < 0).any() or (commit_lsns < 0).any() or (end_lsns < 0).any():
        return None  # past 2^63: the per-message path names it
    # read_uint's 8-byte values are int64: a timestamp reads signed, as the decoder reads it.
    commits = list(zip(commit_lsns.tolist(), end_lsns.tolist(), read_uint(buf, commit_at + 18, 8).tolist(),
                       strict=True))
    xids = read_uint(buf, begin_at + 17, 4).tolist()

    # Where each transaction's rows are among the run's rows: the rows before a message position.
    rows_before = np.cumsum(is_row) - is_row
    begin_rows, commit_rows = rows_before[is_begin].tolist(), rows_before[is_commit].tolist()
    size_before = np.concatenate(([0], np.cumsum(lengths[is_row]))).tolist()
    # Each row's seq: its place in its transaction (after the open transaction's changes, for its rows).
    transaction_of_row = np.cumsum(is_begin)[is_row]
    first_seq = np.concatenate(([-(open_changes or 0)], rows_before[is_begin]))
    seqs = np.arange(len(row_starts)) - first_seq[transaction_of_row]
    run = RunColumns(spans.data, row_starts, ends[is_row], tags[is_row], seqs, lsns[is_row].astype(np.int64),
                     np.searchsorted(known, oids), in_force, source)
    row_count = len(row_starts)
    leading_end = commit_rows[0] if open_changes is not None and commit_rows else \
        (row_count if open_changes is not None else 0)
    leading_commit = commits[0] if open_changes is not None and commit_rows else None
    own_commits = commits[1:] if leading_commit is not None else commits
    own_commit_rows = commit_rows[1:] if leading_commit is not None else commit_rows
    begin_lsns = lsns[is_begin].tolist()
    transactions = []
    for index, (xid, first_row) in enumerate(zip(xids, begin_rows, strict=True)):
        committed = index < len(own_commits)
        last_row = own_commit_rows[index] if committed else row_count
        transactions.append(RunTransaction(xid, begin_lsns[index], RunChanges(run, first_row, last_row),
                                           size_before[last_row] - size_before[first_row],
                                           own_commits[index] if committed else None))
    leading = run.changes(0, leading_end) if leading_end else []
    return PlainRun(leading, size_before[leading_end], leading_commit, transactions, int(lsns.max()))
