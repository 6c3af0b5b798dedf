"""Data source options -> the same validated source config ``cdc-apply run`` uses.

The option names are the YAML config's ``source`` keys (``dsn``, ``host``, ``slot``,
``publication``, ``proto_version``, ...), checked by the same model with the same messages,
plus the reader's own: ``path``/``paths`` (capture files), ``table`` (typed images of one table),
``maxChangesPerTrigger`` and ``spill_bytes``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cdc_apply.config import ConfigError, SourceConfig, parse_config
from cdc_apply.spark.typed import parse_table_name

READER_OPTIONS = ("path", "paths", "table", "maxchangespertrigger", "spill_bytes")
LIST_KEYS = ("publication_tables", "skip_origins")


@dataclass(frozen=True)
class ReaderOptions:
    source: SourceConfig
    paths: tuple[str, ...]
    table: tuple[str, str] | None  # (schema, name): typed images of that table only
    max_changes_per_trigger: int | None
    spill_bytes: int


def _int_option(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"pgoutput option {name}: must be a positive integer (got {text!r})") from None
    if value < 1:
        raise ConfigError(f"pgoutput option {name}: must be a positive integer (got {text!r})")
    return value


def _publications(value: str) -> str | list[str]:
    """One publication name, or several as a JSON array (``'["a", "b"]'``): a name may hold a comma."""
    if value.startswith("["):
        try:
            names = json.loads(value)
        except ValueError:
            return value
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return names
    return value


def reader_options(options: dict[str, str]) -> ReaderOptions:
    """Spark hands options over case-insensitively, as strings."""
    lowered = {key.lower(): value for key, value in options.items()}
    paths: list[str] = []
    if "path" in lowered:
        paths.append(lowered["path"])
    if "paths" in lowered:  # DataFrameReader.load([...]) passes a JSON list
        loaded = json.loads(lowered["paths"])
        paths.extend(loaded if isinstance(loaded, list) else [loaded])
    source_keys: dict[str, Any] = {}
    fields = {name.lower(): name for name in SourceConfig.model_fields}
    for key, value in lowered.items():
        if key in READER_OPTIONS:
            continue
        name = fields.get(key, key)
        if name in LIST_KEYS:
            source_keys[name] = [v.strip() for v in value.split(",") if v.strip()]
        elif name == "publication":
            source_keys[name] = _publications(value)
        else:
            source_keys[name] = value
    source = parse_config({"source": source_keys}, "pgoutput option").source
    table = parse_table_name(lowered["table"]) if "table" in lowered else None
    if source.binary and table is None:
        raise ConfigError("pgoutput option binary: needs the table option: without it the images are PostgreSQL text")
    return ReaderOptions(source, tuple(paths), table, _int_option("maxChangesPerTrigger", lowered.get("maxchangespertrigger")),
                         _int_option("spill_bytes", lowered.get("spill_bytes")) or 64 * 1024 * 1024)
