"""What a path target's Delta log says of its writers, read without Spark (for `cdc-apply status`).

Only the SetTransaction (``txn``) actions are read: the newest checkpoint named by
``_last_checkpoint`` (classic, multi-part or V2, Parquet or JSON), then every commit after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


@dataclass(frozen=True)
class WriterVersion:
    version: int
    last_updated_ms: int | None  # when the writer committed it (Delta's ``lastUpdated``)


def _note(versions: dict[str, WriterVersion], txn: dict[str, Any] | None) -> None:
    if txn and txn.get("appId") is not None:
        versions[str(txn["appId"])] = WriterVersion(int(txn["version"]), txn.get("lastUpdated"))


def _json_actions(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def writer_versions(table_path: str | Path) -> dict[str, WriterVersion]:
    """app id -> its last version; {} when the directory holds no Delta table."""
    log_dir = Path(table_path) / "_delta_log"
    versions: dict[str, WriterVersion] = {}
    checkpoint_version = -1
    last = log_dir / "_last_checkpoint"
    if last.exists():
        checkpoint_version = int(json.loads(last.read_text())["version"])
        for part in sorted(log_dir.glob(f"{checkpoint_version:020d}.checkpoint*")):
            if part.suffix == ".parquet":
                schema = pq.read_schema(part)
                if "txn" in schema.names:
                    for txn in pq.read_table(part, columns=["txn"]).column("txn").to_pylist():
                        _note(versions, txn)
            elif part.suffix == ".json":
                for action in _json_actions(part):
                    _note(versions, action.get("txn"))
    commits = sorted((int(p.stem), p) for p in log_dir.glob("*.json") if p.stem.isdigit())
    for number, path in commits:
        if number > checkpoint_version:
            for action in _json_actions(path):
                _note(versions, action.get("txn"))
    return versions
