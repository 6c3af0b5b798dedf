"""Change rows as the ``pgoutput`` Spark data source hands them over.

A Spark source has one schema, but each table's images have their own columns, so by default
the images are maps of column name -> the value as PostgreSQL prints it (text mode). With the
``table`` option the source reads one table and its images are typed structs (``typed.py``). Two more
columns carry what the apply needs to type them exactly as ``cdc-apply run`` does:
``_cdc_relation`` (the Relation message in force) and ``_cdc_change`` (the change's message).

Invariant: the text map values are the bytes PostgreSQL sent, unchanged; SQL NULL is a null value and
an unchanged TOAST column is absent from ``new`` and named in ``unchanged``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import attrgetter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.changerows.run_rows import RunRows
from cdc_apply.transactions import Transaction
from cdc_apply.changerows.codec import ColumnCodec, Segment, where_change
from cdc_apply.changerows.columns import ImageSpans, ParsedImages, ParsedSegment, change_table, parse_segment
from cdc_apply.changerows.segments import ChangeRowBuilder, TableChanges
from cdc_apply.errors import CdcApplyError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.tuple_columns import gather_values
from cdc_apply.pgoutput.decoder import outside_stream_block
from cdc_apply.pgoutput.encode import encode_relation
from cdc_apply.pgtypes import ValueConversionError, exact_text_type
from cdc_apply.spark.typed import IMAGES, TableImages, spark_arrow

IMAGE = pa.map_(pa.string(), pa.string())
TEXT_IMAGE_DDL = "map<string,string>"
_IN_STREAM = attrgetter("in_stream")
_WIRE = attrgetter("wire")


def source_schema(key: pa.DataType, image: pa.DataType) -> pa.Schema:
    """Exactly what Spark expects of ``source_ddl`` (every field nullable, list items named "element")."""
    return pa.schema([
        pa.field("commit_lsn", pa.int64()),
        pa.field("commit_ts", pa.timestamp("us", tz="UTC")),
        pa.field("xid", pa.int64()),
        pa.field("seq", pa.int32()),
        pa.field("origin", pa.string()),
        pa.field("relation_oid", pa.int64()),
        pa.field("schema", pa.string()),
        pa.field("table", pa.string()),
        pa.field("op", pa.string()),
        pa.field("key", key),
        pa.field("old", image),
        pa.field("new", image),
        pa.field("unchanged", pa.list_(pa.field("element", pa.string()))),
        pa.field("truncate_options", pa.int8()),
        pa.field("end_lsn", pa.int64()),
        pa.field("_cdc_relation", pa.binary()),
        pa.field("_cdc_change", pa.binary()),
    ])


def source_ddl(key: str, image: str) -> str:
    return ("commit_lsn bigint, commit_ts timestamp, xid bigint, seq int, origin string, relation_oid bigint, "
            f"schema string, table string, op string, key {key}, old {image}, new {image}, unchanged array<string>, "
            "truncate_options tinyint, end_lsn bigint, _cdc_relation binary, _cdc_change binary")


SOURCE_SCHEMA = source_schema(IMAGE, IMAGE)
SPARK_DDL = source_ddl(TEXT_IMAGE_DDL, TEXT_IMAGE_DDL)


def typed_schema(images: TableImages) -> tuple[pa.Schema, str]:
    """The Arrow schema and Spark DDL of one table's change rows with typed images."""
    return (source_schema(images.arrow_type("key"), images.arrow_type("new")),
            source_ddl(images.spark_ddl("key"), images.spark_ddl("new")))


def record_batches(transactions: Iterable[Transaction], builder: ChangeRowBuilder | None = None,
                   images: TableImages | None = None) -> Iterator[pa.RecordBatch]:
    """One record batch per table segment, in stream order within each table; with ``images``,
    only that table's segments, its images typed."""
    for segment in (builder or ChangeRowBuilder()).build(transactions):
        if images is None:
            yield segment_batch(segment)
        elif images.holds(segment.relation):
            yield typed_segment_batch(segment, images)


def segment_batch(segment: TableChanges) -> pa.RecordBatch:
    parsed = parse_segment(segment)
    codec = segment.codec
    every_column = list(range(len(codec.columns)))
    columns = dict(parsed.common)
    columns["key"] = _text_map(parsed, parsed.key or parsed.new, codec.key_indexes)
    columns["old"] = _text_map(parsed, parsed.old, every_column)
    columns["new"] = _text_map(parsed, parsed.new, every_column)
    # The parse joined the changes' messages (parse_images): with no truncate among them, that buffer
    # is the _cdc_change column's data already.
    return _record_batch(columns, segment, SOURCE_SCHEMA, None if parsed.take is not None else parsed.buf)


def typed_segment_batch(segment: TableChanges, images: TableImages) -> pa.RecordBatch:
    table = change_table(segment)
    columns = {name: table[name].combine_chunks() for name in table.column_names}
    columns.update(images.conform(columns, segment))
    return _record_batch(columns, segment, typed_schema(images)[0])


def _record_batch(columns: dict[str, pa.Array], segment: TableChanges, schema: pa.Schema,
                  joined_messages: np.ndarray | None = None) -> pa.RecordBatch:
    """``columns`` plus what the apply needs to type the images again (``foreach_batch``).
    ``joined_messages``: every change's message joined in order, when the caller has them so."""
    changes = segment.changes
    count = len(changes)
    columns["end_lsn"] = pa.array([t.end_lsn for t in segment.transactions], pa.int64())
    columns["_cdc_relation"] = pa.array([encode_relation(segment.relation)]).take(np.zeros(count, np.int32))
    if isinstance(changes, RunRows):  # outside any stream block
        columns["_cdc_change"] = changes.messages()
    elif joined_messages is not None and not any(map(_IN_STREAM, changes)):
        columns["_cdc_change"] = _binary_array(list(map(_WIRE, changes)), joined_messages)
    else:
        columns["_cdc_change"] = _binary_array([None if c.wire is None else outside_stream_block(c.wire, c.in_stream)
                                                for c in changes])
    return pa.RecordBatch.from_arrays([columns[f.name].cast(f.type) for f in schema], schema=schema)


def _binary_array(values: list[bytes | None], joined: np.ndarray | None = None) -> pa.Array:
    """``values`` as one binary array whose data buffer is allocated once: ``pa.array`` grows it value
    by value, which cost up to ten times more for a batch's messages (0.24 s for 100,000).
    ``joined``: ``values`` joined already."""
    if any(value is None for value in values):
        return pa.array(values, pa.binary())
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
    data = pa.py_buffer(b"".join(values) if joined is None else joined)
    return pa.Array.from_buffers(pa.large_binary(), len(values), [None, pa.py_buffer(offsets), data]).cast(pa.binary())


def _text_map(parsed: ParsedSegment, image: ImageSpans, indexes: list[int]) -> pa.Array:
    names = parsed.segment.codec.columns
    rows = len(parsed.wired)
    kinds = image.kinds[:, indexes]
    # absent: 'u' and rows without the image
    included = (kinds == m.KIND_TEXT) | (kinds == m.KIND_BINARY) | (kinds == m.KIND_NULL)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(included.sum(axis=1), out=offsets[1:])
    row, position = np.nonzero(included)  # row-major: each row's columns in table order
    if (kinds == m.KIND_BINARY).any():  # values to render as text first, a column at a time
        values = [_as_postgres_text(parsed, names[i], kinds[:, j],
                                    gather_values(parsed.buf, kinds[:, j], image.starts[:, i], image.lengths[:, i]))
                  for j, i in enumerate(indexes)]
        stacked = pa.concat_arrays(values) if values else pa.array([], pa.large_binary())
        items = stacked.take(pa.array(position * rows + row))
    else:  # the items' bytes gathered in the map's own order, in one pass
        column = np.asarray(indexes, np.int64)[position]
        items = gather_values(parsed.buf, kinds[row, position], image.starts[row, column], image.lengths[row, column])
    keys = pa.array([names[i].name for i in indexes], pa.string()).take(pa.array(position))
    result = pa.MapArray.from_arrays(pa.array(offsets), keys, items.cast(pa.large_string()).cast(pa.string()),
                                     mask=pa.array(~image.present))
    return result if parsed.take is None else result.take(parsed.take)


def _as_postgres_text(parsed: ParsedSegment, column: ColumnCodec, kinds: np.ndarray, values: pa.Array) -> pa.Array:
    """A column's values as PostgreSQL's text: binary-format values (a source read with
    ``binary = true``) rendered as PostgreSQL prints them (``pgtypes/exact_text.py``)."""
    binary_rows = np.flatnonzero(kinds == m.KIND_BINARY)
    if not len(binary_rows):
        return values
    as_text = exact_text_type(column.pg_type)
    items = values.to_pylist()
    for row in binary_rows.tolist():
        try:
            items[row] = as_text.from_binary(items[row], column.typmod).encode()
        except (ValueConversionError, ValueError) as exc:
            raise column.conversion_error(parsed.where(row), exc) from None
    return pa.array(items, pa.large_binary())


class MicroBatchRows:
    """A micro-batch of the data source's change rows, as the apply takes rows parsed already
    (``changerows.columns.ParsedRows``), so ``foreach_batch`` parses nothing twice:

    - typed images (the ``table`` option) are a segment's change rows as they are, when the read
      schema types the images as the apply does (else the changes' messages are converted: a
      column added since the read, or a ``columns.<name>.type`` the config sets);
    - text maps are the values to convert, as spans over the map values: the inverse of
      ``segment_batch``. A present ``new`` map holds every column but those named in
      ``unchanged``; a present ``key`` map every key column; an ``old`` map's absent columns were
      unchanged TOAST, which the change rows hold as null either way. A map naming a column twice,
      or one its relation does not have, is refused.
    """

    def __init__(self, frame: pa.Table, row_of: Mapping[int, int]) -> None:
        self.frame = frame
        self.row_of = row_of  # id(change) -> its row in ``frame``
        self.text = all(pa.types.is_map(frame.schema.field(name).type) for name in IMAGES)

    def _take(self, segment: Segment, indexes: Iterable[int]) -> pa.Table:
        changes = segment.changes
        return self.frame.take(pa.array([self.row_of[id(changes[i])] for i in indexes], pa.int64())).combine_chunks()

    def table(self, segment: Segment) -> pa.Table | None:
        schema = segment.schema()
        if self.text or any(self.frame.schema.field(name).type != spark_arrow(schema.field(name).type)
                            for name in IMAGES):
            return None
        picked = self._take(segment, range(len(segment.changes)))
        return pa.Table.from_arrays([picked[f.name].cast(f.type) for f in schema], schema=schema)

    def images(self, segment: Segment, wired: list[int]) -> ParsedImages | None:
        if not self.text or not wired:
            return None
        picked = self._take(segment, wired)
        maps = [picked[name].chunk(0) for name in IMAGES]
        values = pa.concat_arrays([image.items.cast(pa.large_binary()) for image in maps])
        value_offsets = np.frombuffer(values.buffers()[1], np.int64)[values.offset:values.offset + len(values) + 1]
        data = values.buffers()[2]
        buf = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)

        def where(row: int) -> str:
            return where_change(segment.transactions[wired[row]], segment.changes[wired[row]])

        codec = segment.codec
        names = pa.array([column.name for column in codec.columns], pa.string())
        spans: list[ImageSpans] = []
        base = 0
        for label, image in zip(IMAGES, maps):
            spans.append(_spans_of_map(label, image, names, value_offsets[base:], where))
            base += len(image.items)
        key, old, new = spans
        unchanged = picked["unchanged"].chunk(0)
        if len(unchanged.values):
            toast_rows = np.repeat(np.arange(len(wired)), np.diff(np.asarray(unchanged.offsets)))
            toast_columns = _column_indexes("unchanged", unchanged.flatten(), names, toast_rows, where)
            also_sent = new.kinds[toast_rows, toast_columns] != 0
            if also_sent.any():
                raise CdcApplyError(f"{where(int(toast_rows[int(np.argmax(also_sent))]))}: a column of new is also "
                                    "named in unchanged")
            new.kinds[toast_rows, toast_columns] = m.KIND_UNCHANGED_TOAST
        _require_columns("new", new, range(len(codec.columns)), names, where)
        _require_columns("key", key, codec.key_indexes, names, where)
        return ParsedImages(buf, key, old, new)


def _spans_of_map(label: str, image: pa.MapArray, names: pa.Array, value_offsets: np.ndarray,
                  where: Callable[[int], str]) -> ImageSpans:
    """One image's spans; ``value_offsets`` start at the image's first map item."""
    rows, columns = len(image), len(names)
    offsets = np.asarray(image.offsets).astype(np.int64)
    item_rows = np.repeat(np.arange(rows), np.diff(offsets))
    first, last = int(offsets[0]), int(offsets[-1])
    item_columns = _column_indexes(label, image.keys.slice(first, last - first), names, item_rows, where)
    items = np.arange(first, last)
    slots = item_rows * columns + item_columns
    if len(slots) and np.bincount(slots).max() > 1:
        row = item_rows[int(np.argmax(np.bincount(slots)[slots] > 1))]
        raise CdcApplyError(f"{where(int(row))}: {label} names a column twice")
    kinds = np.zeros((rows, columns), np.uint8)
    starts = np.zeros((rows, columns), np.int64)
    lengths = np.zeros((rows, columns), np.int64)
    is_null = np.asarray(image.items.slice(first, last - first).is_null(), bool)
    kinds[item_rows, item_columns] = np.where(is_null, m.KIND_NULL, m.KIND_TEXT)
    starts[item_rows, item_columns] = value_offsets[items]
    lengths[item_rows, item_columns] = value_offsets[items + 1] - value_offsets[items]
    present = np.asarray(image.is_valid(), bool)
    return ImageSpans(kinds, starts, lengths, present)


def _column_indexes(label: str, keys: pa.Array, names: pa.Array, item_rows: np.ndarray,
                    where: Callable[[int], str]) -> np.ndarray:
    found = pc.index_in(keys, value_set=names.cast(keys.type))
    if found.null_count:
        position = int(np.argmax(np.asarray(found.is_null(), bool)))
        raise CdcApplyError(f"{where(int(item_rows[position]))}: {label} names column {keys[position].as_py()!r}, "
                            "which its relation does not have")
    return np.asarray(found, np.int64)


def _require_columns(label: str, image: ImageSpans, indexes: Iterable[int], names: pa.Array,
                     where: Callable[[int], str]) -> None:
    indexes = list(indexes)
    missing = image.present[:, None] & (image.kinds[:, indexes] == 0)
    if missing.any():
        row, column = np.argwhere(missing)[0]
        raise CdcApplyError(f"{where(int(row))}: {label} lacks column {names[indexes[column]].as_py()!r}")
