"""What a path target's Delta log says of its writers, read without Spark (for `cdc-apply status`).

Only the SetTransaction (``txn``) actions are read: the newest checkpoint named by
``_last_checkpoint`` (classic, multi-part or V2, Parquet or JSON), then every commit after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from cdc_apply.lake.location import Location, Storage


@dataclass(frozen=True)
class WriterVersion:
    version: int
    last_updated_ms: int | None  # when the writer committed it (Delta's ``lastUpdated``)


def _note(versions: dict[str, WriterVersion], txn: dict[str, Any] | None) -> None:
    if txn and txn.get("appId") is not None:
        versions[str(txn["appId"])] = WriterVersion(int(txn["version"]), txn.get("lastUpdated"))


def writer_versions(table: str | Location, storage: Storage | None = None) -> dict[str, WriterVersion]:
    """app id -> its last version; {} when the location holds no Delta table."""
    storage = storage or Storage()
    log_dir = Location.parse(table).child("_delta_log")
    versions: dict[str, WriterVersion] = {}
    checkpoint_version = -1
    names = storage.names(log_dir)
    last = storage.read_text(log_dir.child("_last_checkpoint")) if "_last_checkpoint" in names else None
    if last is not None:
        checkpoint_version = int(json.loads(last)["version"])
        for name in sorted(n for n in names if n.startswith(f"{checkpoint_version:020d}.checkpoint")):
            if name.endswith(".parquet"):
                filesystem, path = storage.filesystem(log_dir.child(name))
                parquet = pq.ParquetFile(filesystem.open_input_file(path))
                if "txn" in parquet.schema_arrow.names:
                    for txn in parquet.read(columns=["txn"]).column("txn").to_pylist():
                        _note(versions, txn)
            elif name.endswith(".json"):
                for action in _json_actions(storage.read_text(log_dir.child(name)) or ""):
                    _note(versions, action.get("txn"))
    commits = sorted((int(name[:-5]), name) for name in names if name.endswith(".json") and name[:-5].isdigit())
    for number, name in commits:
        if number > checkpoint_version:
            for action in _json_actions(storage.read_text(log_dir.child(name)) or ""):
                _note(versions, action.get("txn"))
    return versions


def _json_actions(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
