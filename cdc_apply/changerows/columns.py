"""Change rows of one table segment as Arrow, built a column at a time.

The contract is ``changerows.codec.change_row``'s (docs/architecture.md); this builder must give the
same table (tests/test_golden_capture.py and tests/test_type_roundtrip.py compare them on real
captures, tests/test_columnar_fuzz.py on mutated ones). The row images of every change are parsed
together (``pgoutput/tuple_columns.py``) and each image column is converted by the type's vector
converter (``PgType.vector_text``/``vector_binary``, ``pgtypes/vectorized.py``), falling back to
the type's scalar converter for a column the vector one declines.

Invariant: a malformed message is never read as data. Any change the vector parse flags is
re-decoded alone by the scalar path, which raises the error naming its LSN and byte offset.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from operator import attrgetter
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from cdc_apply.arrow_nulls import null_array
from cdc_apply.changerows.run_rows import RunRows, message_spans
from cdc_apply.transactions import Change, Transaction
from cdc_apply.changerows.codec import ColumnCodec, RelationCodec, Segment, change_row, where_change
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import pg_us_to_unix_us
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.tuple_columns import TupleSpans, gather_values, parse_tuples
from cdc_apply.pgoutput.decoder import row_marker_offset
from cdc_apply.pgtypes import ValueConversionError
from cdc_apply.pgtypes.vectorized import FALLBACK_ERRORS, VectorFallback, convert_binary, convert_text

_N, _K, _O, _U, _T = (ord(c) for c in "NKOUT")
_OP_CODES = np.array([ord(c) for c in "DITU"], np.uint8)
_OP, _SEQ, _IN_STREAM, _TRUNCATE_OPTIONS = (attrgetter(name) for name in ("op", "seq", "in_stream", "truncate_options"))


@cache
def _op_names() -> pa.Array:
    """Made on first use, not at import: ``pa.array`` imports pandas (0.5 s of CPU), which the data
    source's planning workers, importing this module but never building a row, do not need."""
    return pa.array(list("DITU"), pa.string())


@dataclass
class ImageSpans:
    """One row image over the wire-backed changes: spans per column, and which rows have it."""

    kinds: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    present: np.ndarray


class ParsedImages(NamedTuple):
    """The key, old and new images of a segment's changes (those with images), as spans over one buffer."""

    buf: np.ndarray
    key: ImageSpans | None  # None: every key image is the new row's
    old: ImageSpans
    new: ImageSpans


class ParsedRows(Protocol):
    """Change rows parsed already by whoever delivered them: ``foreach_batch`` has the data source's
    rows (``spark/rows.py``, ``MicroBatchRows``), a snapshot chunk its COPY values (``InsertedRows``).
    Either method may give None: then the segment's messages are parsed and converted as usual."""

    def table(self, segment: Segment) -> pa.Table | None:
        """The segment's change rows, typed as ``segment.schema()``."""

    def images(self, segment: Segment, wired: list[int]) -> ParsedImages | None:
        """The images of the segment's changes at ``wired``, to be converted."""


@dataclass
class ParsedSegment:
    """A segment's row images parsed (not yet converted), with the columns every form shares."""

    segment: Segment
    wired: list[int]  # rows whose change holds message bytes (all but truncates)
    buf: np.ndarray
    key: ImageSpans | None  # None: every key image is the new row's
    old: ImageSpans
    new: ImageSpans
    take: pa.Array | None  # wired position of each row, when truncates are mixed in
    common: dict[str, pa.Array]  # every change-row column but the images

    def where(self, row: int) -> str:
        index = self.wired[row]
        return where_change(self.segment.transactions[index], self.segment.changes[index])


def parse_segment(segment: Segment, parsed: ParsedRows | None = None) -> ParsedSegment:
    """``parsed`` may give the images parsed already; else every row change must hold its message
    bytes (``segment.from_stream``), which are parsed."""
    changes = segment.changes
    count = len(changes)
    columnar = isinstance(changes, RunRows)
    ops = changes.ops() if columnar else _ops(changes)
    truncates = ops == _T
    if not truncates.any():
        wired = list(range(count))
    else:  # a listed change of a RunRows holds its message unless it is a truncate
        wired = np.flatnonzero(~truncates).tolist() if columnar else [i for i, c in enumerate(changes) if c.wire is not None]
    images = None if parsed is None else parsed.images(segment, wired)
    if images is None:
        images = parse_images(segment, wired)
    buf, key, old, new = images
    relation = segment.relation
    common = _transaction_columns(segment.transactions)
    common.update({
        "seq": pa.array(changes.seqs().astype(np.int32) if columnar else np.fromiter(map(_SEQ, changes), np.int32, count)),
        "relation_oid": pa.array(np.full(count, relation.oid, np.int64)),
        "schema": pa.array([relation.namespace]).take(np.zeros(count, np.int32)),
        "table": pa.array([relation.name]).take(np.zeros(count, np.int32)),
        "op": _op_names().take(np.searchsorted(_OP_CODES, ops)),
        "unchanged": _unchanged(new, segment.codec, count, wired),
        "truncate_options": (pa.array(changes.truncate_options() if columnar
                                      else np.fromiter(map(_TRUNCATE_OPTIONS, changes), np.int8, count), mask=~truncates)
                             if truncates.any() else null_array(count, pa.int8())),
    })
    take = None if len(wired) == count else _row_index(count, wired)
    return ParsedSegment(segment, wired, buf, key, old, new, take, common)


def change_table(segment: Segment, rows: ParsedRows | None = None) -> pa.Table:
    """The segment's change rows with typed images; every row change must hold its message bytes,
    unless ``rows`` gives the images parsed already."""
    parsed = parse_segment(segment, rows)
    buf, take, where = parsed.buf, parsed.take, parsed.where
    codec = segment.codec
    every_column = list(range(len(codec.columns)))
    new, old, key = parsed.new, parsed.old, parsed.key
    new_children = _children(buf, new, codec, every_column, where)
    if key is None:  # reuse the new image's converted key columns
        key_children = None if new_children is None else [new_children[i] for i in codec.key_indexes]
        key_struct = _struct(key_children, codec, codec.key_indexes, new.present, take)
    else:
        key_struct = _struct(_children(buf, key, codec, codec.key_indexes, where), codec, codec.key_indexes,
                             key.present, take)
    columns = dict(parsed.common)
    columns.update({
        "key": key_struct,
        "old": _struct(_children(buf, old, codec, every_column, where), codec, every_column, old.present, take),
        "new": _struct(new_children, codec, every_column, new.present, take),
    })
    schema = segment.schema()
    return pa.Table.from_arrays([columns[f.name].cast(f.type) for f in schema], schema=schema)


def _transaction_columns(txns: list[Transaction]) -> dict[str, pa.Array]:
    """Per-transaction fields, read once per transaction and repeated over its changes."""
    ids = np.fromiter(map(id, txns), np.int64, len(txns))
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1]))) if len(ids) else np.zeros(0, np.int64)
    run = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(ids))))
    heads = [txns[i] for i in starts]
    return {
        "commit_lsn": pa.array([t.commit_lsn for t in heads], pa.int64()).take(run),
        "commit_ts": pa.array([pg_us_to_unix_us(t.commit_ts) for t in heads], pa.int64()).take(run),
        "xid": pa.array([t.xid for t in heads], pa.int64()).take(run),
        "origin": pa.array([t.origin for t in heads], pa.string()).take(run),
    }


def _row_index(count: int, wired: list[int]) -> pa.Array:
    """For each change row, its index among the wire-backed changes (null for truncates)."""
    index: list[int | None] = [None] * count
    for position, row in enumerate(wired):
        index[row] = position
    return pa.array(index, type=pa.int64())


def parse_images(segment: Segment, wired: list[int]) -> ParsedImages:
    """The images of the wire-backed changes, parsed from their messages: where they lie in the
    runs' buffer (``RunRows``), else joined."""
    columns = len(segment.codec.columns)
    if isinstance(segment.changes, RunRows):  # none inside a stream block
        buf, starts, ends = message_spans(segment.changes.messages())
        ops = segment.changes.ops()
        if len(wired) < len(ops):
            starts, ends, ops = starts[wired], ends[wired], ops[wired]
        markers_at = starts + row_marker_offset(False)
    else:
        changes = segment.changes if len(wired) == len(segment.changes) else [segment.changes[i] for i in wired]
        wires = [c.wire or b"" for c in changes]
        in_stream = np.fromiter(map(_IN_STREAM, changes), bool, len(changes))
        lengths = np.fromiter(map(len, wires), np.int64, len(wires))
        ends = np.cumsum(lengths)
        buf = np.frombuffer(b"".join(wires), np.uint8)
        markers_at = ends - lengths + np.where(in_stream, row_marker_offset(True), row_marker_offset(False))
        ops = _ops(changes)
    markers = buf[markers_at] if len(buf) else np.zeros(0, np.uint8)

    first = parse_tuples(buf, markers_at + 1, ends, columns)
    bad = first.bad.copy()
    end = first.end.copy()
    two = (ops == _U) & (markers != _N)  # an Update with an old image: then 'N' and the new tuple
    second_rows = np.nonzero(two)[0]
    second = None
    if len(second_rows):
        between = first.end[second_rows]
        marker_ok = (between < ends[second_rows]) & (buf[np.clip(between, 0, len(buf) - 1)] == _N)
        second = parse_tuples(buf, between + 1, ends[second_rows], columns)
        bad[second_rows] |= ~marker_ok | second.bad
        end[second_rows] = second.end
    bad |= end != ends
    if bad.any():
        _raise_scalar_error(segment, wired[int(np.argmax(bad))])

    new_in_first = markers == _N
    new = _image_from(first, new_in_first)
    if second is not None:
        new.kinds[second_rows] = second.kinds
        new.starts[second_rows] = second.starts
        new.lengths[second_rows] = second.lengths
        new.present[second_rows] = True
    old = _image_from(first, markers == _O)
    key_in_first = (markers == _K) | (markers == _O)
    if not key_in_first.any():
        return ParsedImages(buf, None, old, new)
    key = ImageSpans(np.where(key_in_first[:, None], first.kinds, new.kinds),
                     np.where(key_in_first[:, None], first.starts, new.starts),
                     np.where(key_in_first[:, None], first.lengths, new.lengths),
                     key_in_first | new.present)
    return ParsedImages(buf, key, old, new)


def _ops(changes: list[Change]) -> np.ndarray:
    return np.frombuffer("".join(map(_OP, changes)).encode(), np.uint8)


def inserted_images(buf: np.ndarray, is_null: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> ParsedImages:
    """The images (no key, no old, the new) of inserts whose new rows are text values as spans over
    ``buf`` already (a snapshot chunk's COPY rows): the spans the parse of message bytes gives."""
    rows, columns = is_null.shape
    new = ImageSpans(np.where(is_null, m.KIND_NULL, m.KIND_TEXT).astype(np.uint8), starts, lengths, np.ones(rows, bool))
    none = ImageSpans(np.zeros((rows, columns), np.uint8), np.zeros((rows, columns), np.int64),
                      np.zeros((rows, columns), np.int64), np.zeros(rows, bool))
    return ParsedImages(buf, None, none, new)


@dataclass
class InsertedRows:
    """The ``ParsedRows`` of a snapshot chunk: inserts without message bytes, every new image given."""

    given: ParsedImages

    def table(self, segment: Segment) -> pa.Table | None:
        return None

    def images(self, segment: Segment, wired: list[int]) -> ParsedImages:
        return self.given

    def new_tuples(self) -> list[m.TupleData]:
        """The new images one by one, for the change-by-change conversion (a value Arrow cannot hold)."""
        new, buf = self.given.new, self.given.buf
        return [m.TupleData(kinds.tobytes(), tuple(None if kind == m.KIND_NULL else buf[start:start + length].tobytes()
                                                   for kind, start, length in zip(kinds.tolist(), starts.tolist(),
                                                                                  lengths.tolist())))
                for kinds, starts, lengths in zip(new.kinds, new.starts, new.lengths)]


def _image_from(spans: TupleSpans, rows: np.ndarray) -> ImageSpans:
    """The image ``rows`` have in ``spans``; other rows get kind 0 (no value), which is what
    gathering and the unchanged-TOAST list look at, so their starts and lengths can stay."""
    return ImageSpans(np.where(rows[:, None], spans.kinds, 0).astype(np.uint8), spans.starts.copy(),
                      spans.lengths.copy(), rows.copy())


def _raise_scalar_error(segment: Segment, row: int) -> None:
    txn, change = segment.transactions[row], segment.changes[row]
    change_row(txn, change, segment.codec)  # raises the located decode or column-count error
    raise CdcApplyError(f"{where_change(txn, change)}: the columnar parse rejected a change the "
                        "scalar decoder accepts; please report this with the capture")


def _children(buf: np.ndarray, image: ImageSpans, codec: RelationCodec, indexes: list[int],
              where: Callable[[int], str]) -> list[pa.Array] | None:
    """The image's columns converted; None when no change row has this image."""
    if not image.present.any():
        return None
    return [_column(buf, image.kinds[:, i], image.starts[:, i], image.lengths[:, i], codec.columns[i], where)
            for i in indexes]


def _struct(children: list[pa.Array] | None, codec: RelationCodec, indexes: list[int], present: np.ndarray,
            take: pa.Array | None) -> pa.Array:
    arrow = codec.image_type(indexes)
    if children is None:
        return null_array(len(present) if take is None else len(take), arrow)
    if not indexes:
        struct = pa.array([{} if p else None for p in present], type=arrow)
    else:
        struct = pa.StructArray.from_arrays(children, fields=list(arrow), mask=pa.array(~present))
    return struct if take is None else struct.take(take)


def _column(buf: np.ndarray, kinds: np.ndarray, starts: np.ndarray, lengths: np.ndarray, column: ColumnCodec,
            where: Callable[[int], str]) -> pa.Array:
    raw = gather_values(buf, kinds, starts, lengths)
    if not np.any(kinds == m.KIND_BINARY):
        return text_column(raw, column, where)
    try:
        if np.any(kinds == m.KIND_TEXT):
            raise VectorFallback("text and binary values mixed in one column")
        values = convert_binary(column.pg_type, raw, column.arrow)
        return values if values.type == column.arrow else values.cast(column.arrow)
    except FALLBACK_ERRORS:
        return _scalar_column(raw, kinds, column, where)


def text_column(raw: pa.Array, column: ColumnCodec, where: Callable[[int], str]) -> pa.Array:
    """One column of text values (``large_binary``, UTF-8; null for NULL) converted: a column at a
    time where its vector converter takes them, else value by value (the located errors)."""
    try:
        values = convert_text(column.pg_type, raw.cast(pa.large_string()), column.arrow)
        return values if values.type == column.arrow else values.cast(column.arrow)
    except FALLBACK_ERRORS:
        kinds = np.where(np.asarray(raw.is_null().to_numpy(zero_copy_only=False), bool), m.KIND_NULL, m.KIND_TEXT)
        return _scalar_column(raw, kinds.astype(np.uint8), column, where)


def _scalar_column(raw: pa.Array, kinds: np.ndarray, column: ColumnCodec, where: Callable[[int], str]) -> pa.Array:
    values: list[Any] = []
    for row, value in enumerate(raw.to_pylist()):
        if value is None:
            values.append(None)
            continue
        try:
            values.append(column.convert(int(kinds[row]), value))
        except (ValueConversionError, UnicodeDecodeError, ValueError) as exc:
            raise column.conversion_error(where(row), exc) from None
    try:
        return pa.array(values, type=column.arrow)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise NotArrowRepresentable(f"column {column.name!r} ({column.pg_type.name}) holds a value its Arrow type "
                                    f"{column.arrow} cannot (a multi-dimensional array?): {exc}") from None


class NotArrowRepresentable(CdcApplyError):
    """A decoded value the column's Arrow type cannot hold (a multi-dimensional array in a depth-one
    array column). Python change rows can still carry it; the apply decides (docs/apply.md)."""


def _unchanged(new: ImageSpans, codec: RelationCodec, count: int, wired: list[int]) -> pa.Array:
    """Per change row, the columns sent as unchanged TOAST; an empty list when none (truncates too)."""
    toast = new.kinds == m.KIND_UNCHANGED_TOAST
    per_row = np.zeros(count, dtype=np.int32)
    per_row[wired] = toast.sum(axis=1)
    offsets = np.zeros(count + 1, dtype=np.int32)
    np.cumsum(per_row, out=offsets[1:])
    names = pa.array([c.name for c in codec.columns], pa.string()).take(pa.array(np.nonzero(toast)[1]))
    return pa.ListArray.from_arrays(pa.array(offsets), names)


def python_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Arrow change rows -> the Python values ``change_row`` gives (it carries timestamps as
    microseconds and dates as days since 1970, which hold infinities; Arrow would give datetimes)."""
    return table.cast(pa.schema([f.with_type(_python_view(f.type)) for f in table.schema])).to_pylist()


def _python_view(arrow: pa.DataType) -> pa.DataType:
    if pa.types.is_timestamp(arrow):
        return pa.int64()
    if pa.types.is_date32(arrow):
        return pa.int32()
    if pa.types.is_list(arrow):
        return pa.list_(_python_view(arrow.value_type))
    if pa.types.is_struct(arrow):
        return pa.struct([arrow.field(i).with_type(_python_view(arrow.field(i).type)) for i in range(arrow.num_fields)])
    return arrow
