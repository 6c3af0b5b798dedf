"""JSON-ready views of messages and change rows, for `cdc-apply decode` and notebooks."""

from __future__ import annotations

import dataclasses
from typing import Any

from cdc_apply.changerows.segments import TableChanges
from cdc_apply.lsn import format_lsn, pg_us_to_datetime
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes.datetime import format_timestamp


def _tuple_json(data: m.TupleData) -> list[dict[str, Any]]:
    out = []
    for kind, raw in zip(data.kinds, data.values, strict=True):
        entry: dict[str, Any] = {"kind": chr(kind)}
        if kind == m.KIND_TEXT and raw is not None:
            entry["value"] = raw.decode("utf-8", errors="replace")
        elif kind == m.KIND_BINARY and raw is not None:
            entry["hex"] = raw.hex()
        out.append(entry)
    return out


def _field_json(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name.endswith("_lsn") or name == "lsn":
        return format_lsn(value)
    if name.endswith("_ts"):
        return pg_us_to_datetime(value).isoformat()
    if isinstance(value, m.TupleData):
        return _tuple_json(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"hex": value.hex()}
    if isinstance(value, tuple):
        return [_field_json(name, v) for v in value]
    if dataclasses.is_dataclass(value):
        return {f.name: _field_json(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def message_json(message: m.Message, lsn: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tag": message.tag, "lsn": format_lsn(lsn), "type": type(message).__name__}
    for f in dataclasses.fields(message):
        out[f.name] = _field_json(f.name, getattr(message, f.name))
    return out


def _image_json(segment: TableChanges, image: dict[str, Any] | None) -> dict[str, Any] | None:
    if image is None:
        return None
    types = {c.name: c.pg_type for c in segment.codec.columns}
    return {name: (None if value is None else types[name].to_json(value)) for name, value in image.items()}


def change_row_json(segment: TableChanges, row: dict[str, Any]) -> dict[str, Any]:
    return {
        **row,
        "commit_lsn": format_lsn(row["commit_lsn"]),
        "commit_ts": format_timestamp(row["commit_ts"], utc_suffix=True),
        "key": _image_json(segment, row["key"]),
        "old": _image_json(segment, row["old"]),
        "new": _image_json(segment, row["new"]),
    }
