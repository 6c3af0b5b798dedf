"""Capture files (README, "Capture files"): JSON Lines or Parquet with columns lsn (X/Y), xid, data (hex / binary),
and type_facts (text, on a Type message's row only: the catalog's facts binary mode needs, pgtypes/user.py)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from cdc_apply.errors import CaptureError
from cdc_apply.lsn import format_lsn, parse_lsn
from cdc_apply.pgoutput.decoder import PgOutputDecoder
from cdc_apply.pgoutput.messages import Type
from cdc_apply.pgtypes.registry import ValueConversionError
from cdc_apply.pgtypes.user import parse_facts
from cdc_apply.sources.raw import RawMessage

PARQUET_SUFFIXES = (".parquet", ".pq")
MAX_XID = 2**64 - 1  # a FullTransactionId at most; pgoutput's are 32-bit

log = logging.getLogger(__name__)


def read_capture(path: str | Path) -> Iterator[RawMessage]:
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _read_parquet(path)
    return _read_jsonl(path)


def read_captures(paths: Iterable[str | Path]) -> Iterator[RawMessage]:
    """Every message of ``paths`` in order. An LSN lower than or equal to the one before is kept
    (a capture may repeat a message the slot sent again) but warned about, once per file."""
    previous: RawMessage | None = None
    for path in paths:
        warned = False
        for raw in read_capture(path):
            if previous is not None and raw.lsn < previous.lsn and not warned:
                log.warning("%s: LSN %s goes back from %s at %s; the messages are applied in file order",
                            raw.source, format_lsn(raw.lsn), format_lsn(previous.lsn), previous.source)
                warned = True
            previous = raw
            yield raw


def _xid(value: object) -> int | None:
    """A capture's xid: null, or a whole number in range (never a float, bool or text)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_XID:
        raise ValueError(f"xid must be a whole number from 0 to {MAX_XID} or null, got {str(value)[:40]!r}")
    return value


def _type_facts(value: object) -> str | None:
    """A capture's type facts: null, or text that parses as the facts (``pgtypes/user.py``); their
    agreement with the values is checked where a value is decoded."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"type_facts must be text or null, got {type(value).__name__}")
    if value is not None:
        try:
            parse_facts(value)
        except ValueConversionError as exc:
            raise ValueError(str(exc)) from None
    return value


def _read_jsonl(path: Path) -> Iterator[RawMessage]:
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise CaptureError(f"{path}: cannot open capture: {exc.strerror}") from None
    with handle:
        for number, raw_line in enumerate(handle, start=1):
            place = f"{path}:{number}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CaptureError(f"{place}: not a capture line (not UTF-8 text at byte {exc.start} of the line; "
                                   "is this a JSON Lines capture?)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError(f"a JSON object per line, got {type(row).__name__}")
                lsn = parse_lsn(row["lsn"])
                data = bytes.fromhex(row["data"])
                xid = _xid(row.get("xid"))
                facts = _type_facts(row.get("type_facts"))
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
                raise CaptureError(f"{place}: not a capture line ({type(exc).__name__}: {str(exc)[:200]})") from None
            yield RawMessage(lsn, xid, data, place, facts)


def _read_parquet(path: Path) -> Iterator[RawMessage]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:
        raise CaptureError(f"{path}: cannot open Parquet capture: {exc}") from None
    missing = {"lsn", "xid", "data"} - set(parquet.schema_arrow.names)
    if missing:
        raise CaptureError(f"{path}: Parquet capture lacks column(s) {', '.join(sorted(missing))}")
    import pyarrow as pa

    schema = parquet.schema_arrow
    expected = {"lsn": (pa.types.is_string, pa.types.is_large_string), "xid": (pa.types.is_integer,),
                "data": (pa.types.is_binary, pa.types.is_large_binary)}
    for column, checks in expected.items():
        kind = schema.field(column).type
        if not any(check(kind) for check in checks):
            raise CaptureError(f"{path}: Parquet capture column {column!r} is {kind}; "
                               "expected lsn string, xid bigint, data binary")
    if "type_facts" in schema.names and not any(check(schema.field("type_facts").type)
                                                 for check in (pa.types.is_string, pa.types.is_large_string)):
        raise CaptureError(f"{path}: Parquet capture column 'type_facts' is {schema.field('type_facts').type}; "
                           "expected string")
    columns = ["lsn", "xid", "data", *(["type_facts"] if "type_facts" in schema.names else [])]
    row_number = 0
    for batch in parquet.iter_batches(columns=columns):
        facts_column = batch.column(3).to_pylist() if len(columns) == 4 else [None] * batch.num_rows
        for lsn_text, xid, data, facts in zip(*(batch.column(i).to_pylist() for i in range(3)), facts_column,
                                              strict=True):
            row_number += 1
            try:
                lsn = parse_lsn(lsn_text)
                xid = _xid(xid)
                facts = _type_facts(facts)
                if data is None:
                    raise ValueError("data is null")
            except (ValueError, AttributeError, TypeError) as exc:
                raise CaptureError(f"{path}: row {row_number}: {exc}") from None
            yield RawMessage(lsn, xid, bytes(data), f"{path}:row {row_number}", facts)


def with_type_facts(messages: Iterable[RawMessage], type_facts: Callable[[int], str | None]) -> Iterator[RawMessage]:
    """``messages`` with the source catalog's facts on each Type message's row, so that a binary capture
    decodes offline (docs/types.md, "User-defined types")."""
    decoder = PgOutputDecoder()
    for msg in messages:
        if msg.data[:1] in b"SEY":  # only Stream Start/Stop change where a Type message's fields are
            decoded = decoder.decode(msg.data)
            if isinstance(decoded, Type):
                msg.type_facts = type_facts(decoded.oid)
        yield msg


def write_jsonl(path: str | Path, messages: Iterable[RawMessage]) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for msg in messages:
            row = {"lsn": format_lsn(msg.lsn), "xid": msg.xid, "data": msg.data.hex()}
            if msg.type_facts is not None:
                row["type_facts"] = msg.type_facts
            handle.write(json.dumps(row) + "\n")
            count += 1
    _fsync(path)
    return count


def write_parquet(path: str | Path, messages: Iterable[RawMessage]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(messages)
    table = pa.table({
        "lsn": pa.array([format_lsn(r.lsn) for r in rows], pa.string()),
        "xid": pa.array([r.xid for r in rows], pa.int64()),
        "data": pa.array([r.data for r in rows], pa.binary()),
        "type_facts": pa.array([r.type_facts for r in rows], pa.string()),
    })
    pq.write_table(table, path)
    _fsync(path)
    return len(rows)


def _fsync(path: str | Path) -> None:
    """A capture may be the only copy of what ``capture --consume`` takes off the slot."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
