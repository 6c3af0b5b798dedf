"""Capture files (DESIGN.md): JSON Lines or Parquet with columns lsn (X/Y), xid, data (hex / binary)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from cdc_apply.errors import CaptureError
from cdc_apply.lsn import format_lsn, parse_lsn
from cdc_apply.sources.raw import RawMessage

PARQUET_SUFFIXES = (".parquet", ".pq")


def read_capture(path: str | Path) -> Iterator[RawMessage]:
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _read_parquet(path)
    return _read_jsonl(path)


def read_captures(paths: Iterable[str | Path]) -> Iterator[RawMessage]:
    for path in paths:
        yield from read_capture(path)


def _read_jsonl(path: Path) -> Iterator[RawMessage]:
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise CaptureError(f"{path}: cannot open capture: {exc.strerror}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            place = f"{path}:{number}"
            try:
                row = json.loads(line)
                lsn = parse_lsn(row["lsn"])
                data = bytes.fromhex(row["data"])
                xid = row.get("xid")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CaptureError(f"{place}: not a capture line ({type(exc).__name__}: {exc})") from None
            yield RawMessage(lsn, None if xid is None else int(xid), data, place)


def _read_parquet(path: Path) -> Iterator[RawMessage]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:
        raise CaptureError(f"{path}: cannot open Parquet capture: {exc}") from None
    missing = {"lsn", "xid", "data"} - set(parquet.schema_arrow.names)
    if missing:
        raise CaptureError(f"{path}: Parquet capture lacks column(s) {', '.join(sorted(missing))}")
    row_number = 0
    for batch in parquet.iter_batches(columns=["lsn", "xid", "data"]):
        for lsn_text, xid, data in zip(*(batch.column(i).to_pylist() for i in range(3)), strict=True):
            row_number += 1
            try:
                lsn = parse_lsn(lsn_text)
            except (ValueError, AttributeError) as exc:
                raise CaptureError(f"{path}: row {row_number}: {exc}") from None
            yield RawMessage(lsn, xid, bytes(data), f"{path}:row {row_number}")


def write_jsonl(path: str | Path, messages: Iterable[RawMessage]) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for msg in messages:
            handle.write(json.dumps({"lsn": format_lsn(msg.lsn), "xid": msg.xid, "data": msg.data.hex()}) + "\n")
            count += 1
    return count


def write_parquet(path: str | Path, messages: Iterable[RawMessage]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(messages)
    table = pa.table({
        "lsn": pa.array([format_lsn(r.lsn) for r in rows], pa.string()),
        "xid": pa.array([r.xid for r in rows], pa.int64()),
        "data": pa.array([r.data for r in rows], pa.binary()),
    })
    pq.write_table(table, path)
    return len(rows)
