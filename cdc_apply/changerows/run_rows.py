"""A table's changes in a batch as columns: the rows of runs' columns (``transactions.RunColumns``,
what the walsender's reads assemble into) and listed ``Change`` objects, in stream order
(``changerows/segments.py`` cuts them; ``changerows/columns.py`` and ``spark/rows.py`` read them).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import pyarrow as pa

from cdc_apply.transactions import Change, ChangesMadeOnDemand, RunColumns

_OP, _SEQ, _WIRE, _TRUNCATE_OPTIONS = (attrgetter(name) for name in ("op", "seq", "wire", "truncate_options"))


class RunRows(ChangesMadeOnDemand):
    """A table's changes in a batch, in order, as pieces: rows of a run's columns (``RunColumns``,
    ``rows``), or a list of ``Change`` objects, none inside a stream block and each I/U/D holding
    its message bytes (``changerows/segments.py``). Its columns are read with no ``Change`` made for a
    run's rows; indexed or iterated, it gives the ``Change`` objects (a run's made once per run)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[RunColumns, np.ndarray] | list[Change]] = []
        self._count = 0
        self._list: list[Change] | None = None
        self._messages: pa.Array | None = None
        self._ops: np.ndarray | None = None

    @staticmethod
    def takes(changes: Sequence[Change]) -> bool:
        """Whether a list of changes can be a piece."""
        return not any(change.in_stream or (change.wire is None and change.op != "T") for change in changes)

    def add(self, piece: tuple[RunColumns, np.ndarray] | list[Change]) -> None:
        """``piece``: a list is the caller's to give (a following list is appended to it)."""
        if isinstance(piece, list) and self.pieces and isinstance(self.pieces[-1], list):
            self.pieces[-1].extend(piece)
        else:
            self.pieces.append(piece)
        self._count += len(piece[1]) if isinstance(piece, tuple) else len(piece)
        self._list = self._messages = self._ops = None

    def __len__(self) -> int:
        return self._count

    def _changes(self) -> list[Change]:
        if self._list is None:
            made: list[Change] = []
            for piece in self.pieces:
                if isinstance(piece, tuple):
                    every = piece[0].all_changes()
                    made.extend(every[row] for row in piece[1].tolist())
                else:
                    made.extend(piece)
            self._list = made
        return self._list

    def ops(self) -> np.ndarray:
        """Each row's op as its tag byte (I, U, D, T); made once (the parse and the collapse both ask)."""
        if self._ops is None:
            self._ops = self._column(lambda run, rows: run.ops[rows],
                                     lambda changes: np.frombuffer("".join(map(_OP, changes)).encode(), np.uint8),
                                     np.uint8)
        return self._ops

    def seqs(self) -> np.ndarray:
        return self._column(lambda run, rows: run.seqs[rows],
                            lambda changes: np.fromiter(map(_SEQ, changes), np.int64, len(changes)), np.int64)

    def truncate_options(self) -> np.ndarray:
        return self._column(lambda run, rows: np.zeros(len(rows), np.int8),
                            lambda changes: np.fromiter(map(_TRUNCATE_OPTIONS, changes), np.int8, len(changes)),
                            np.int8)

    def _column(self, of_run: Any, of_list: Any, dtype: Any) -> np.ndarray:
        parts = [of_run(*piece) if isinstance(piece, tuple) else of_list(piece) for piece in self.pieces]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    def messages(self) -> pa.Array:
        """Each row's message, in order, as one ``large_binary`` array (null for a truncate), its data
        buffer made with one copy of each message: Arrow's take copies a run's messages out of the
        read's buffer."""
        if self._messages is None:
            self._messages = self._joined_messages()
        return self._messages

    def _joined_messages(self) -> pa.Array:
        parts: list[pa.Array] = []
        for piece in self.pieces:
            if isinstance(piece, tuple):
                run, rows = piece
                if not len(rows):
                    continue
                bounds = np.empty(2 * len(rows), np.int64)  # the messages, and the gaps between them
                bounds[0::2], bounds[1::2] = run.starts[rows], run.ends[rows]
                spans = pa.Array.from_buffers(pa.large_binary(), len(bounds) - 1,
                                              [None, pa.py_buffer(bounds), pa.py_buffer(run.data)])
                parts.append(spans.take(pa.array(np.arange(0, len(bounds), 2, dtype=np.int64))))
            else:
                wires = list(map(_WIRE, piece))
                lengths = np.fromiter((0 if wire is None else len(wire) for wire in wires), np.int64, len(wires))
                offsets = np.zeros(len(wires) + 1, np.int64)
                np.cumsum(lengths, out=offsets[1:])
                present = np.fromiter((wire is not None for wire in wires), bool, len(wires))
                validity = None if present.all() else pa.py_buffer(np.packbits(present, bitorder="little"))
                parts.append(pa.Array.from_buffers(
                    pa.large_binary(), len(wires),
                    [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(wire or b"" for wire in wires))],
                    null_count=int(len(wires) - present.sum())))
        return pa.concat_arrays(parts) if parts else pa.array([], pa.large_binary())


def message_spans(messages: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buffer, starts, ends) of a ``large_binary`` array's values."""
    offsets = np.frombuffer(messages.buffers()[1], np.int64)[messages.offset:messages.offset + len(messages) + 1]
    data = messages.buffers()[2]
    return np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8), offsets[:-1], offsets[1:]
