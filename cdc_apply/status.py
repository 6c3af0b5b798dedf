"""`cdc-apply status`: the pipeline's numbers read from the slot and the targets, without the service.

``pipeline_status`` gives the slot's health (retained and unconfirmed WAL, ``wal_status``, the
process reading it), the publication, and per published table its target, the last commit LSN
applied to it (the target's SetTransaction version for this pipeline) and when, and whether a
resync is pending. ``watch`` redraws the same in the terminal every second, with per-table change
rates and the commit -> Delta lag taken from the running service's ``/metrics`` when
``metrics.port`` is set.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families

from cdc_apply.apply.delta_log import writer_versions
from cdc_apply.apply.options import apply_options
from cdc_apply.lake.state import AppliedPosition, ResyncMarks, TargetRegistry
from cdc_apply.config import Config
from cdc_apply.lsn import format_lsn
from cdc_apply.sources.health import missing_publications, publication_tables, read_slot_health, standby_copies


def pipeline_status(config: Config) -> dict[str, Any]:
    source = config.source
    with psycopg.connect(source.conninfo(), autocommit=True, connect_timeout=10) as conn:
        health = read_slot_health(conn, source.slot)
        standbys = standby_copies(source, conn)
        published = publication_tables(conn, source.publications)
        missing = missing_publications(conn, source.publications)
    state = apply_options(config).state
    registry = TargetRegistry(state).entries()
    marks = ResyncMarks(state)
    tables = []
    for oid, name in sorted((published or {}).items(), key=lambda item: item[1]):
        entry = registry.get(oid)
        row: dict[str, Any] = {"table": name, "relation_oid": oid, "target": entry["location"] if entry else None,
                               "applied_lsn": None, "applied_at": None, "resync_pending": marks.pending(oid)}
        if entry and not entry["by_name"]:  # a catalog table's files are the metastore's business
            writer = writer_versions(entry["location"], state.storage).get(f"{config.pipeline}/{oid}")
            if writer is not None:
                row["applied_lsn"] = format_lsn(writer.version)
                if writer.last_updated_ms is not None:
                    row["applied_at"] = datetime.fromtimestamp(writer.last_updated_ms / 1000, timezone.utc).isoformat()
        tables.append(row)
    status = {"pipeline": config.pipeline, "slot": {**health.as_dict(), "standby_copies": standbys},
              "publication": {"names": list(source.publications), "exists": published is not None, "missing": missing},
              "tables": tables}
    if config.changelog.enabled:
        status["changelog"] = changelog_status(config)
    return status


def changelog_status(config: Config) -> dict[str, Any]:
    """Where the change log is, the last commit LSN it holds, and (``confirm_after: changelog``) how far
    every target holds it: the MERGE lag, in WAL bytes, is the difference."""
    settings = config.changelog
    state = apply_options(config).state
    location = None if settings.name is not None else (settings.path or str(state.location("changelog")))
    writer = writer_versions(location, state.storage).get(f"{config.pipeline}/changelog") if location else None
    applied = AppliedPosition(state).read()
    logged = writer.version if writer is not None else None
    return {"location": location or settings.name, "confirm_after": settings.confirm_after,
            "lsn": format_lsn(logged) if logged is not None else None,
            "targets_applied_lsn": format_lsn(applied) if applied is not None else None,
            "targets_behind_bytes": (max(0, logged - applied) if logged is not None and applied is not None
                                     else None)}


def scrape(host: str, port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The service's metrics as (sample name, labels) -> value; {} when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _sum(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
         **labels: str) -> float:
    return sum(value for (sample, found), value in samples.items()
               if sample == name and all((k, v) in found for k, v in labels.items()))


def _under(location: str | None, warehouse: str) -> str:
    if location is None:
        return "(none yet)"
    prefix = warehouse.rstrip("/") + "/"
    return location[len(prefix):] if location.startswith(prefix) else location


def _bytes(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def watch(config: Config, refreshes: int | None = None, interval: float = 1.0,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Redraw the status every ``interval`` seconds (``refreshes`` times, or until Ctrl-C)."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Column, Table

    metrics_port = config.metrics.port or None  # 0 means "any free port": nothing known to scrape
    previous: tuple[float, dict[Any, float]] | None = None
    console = Console()
    done = 0
    with Live(console=console, auto_refresh=False, vertical_overflow="visible") as live:
        while refreshes is None or done < refreshes:
            status = pipeline_status(config)
            now = time.monotonic()
            samples = scrape(config.metrics.host, metrics_port) if metrics_port else {}
            slot = status["slot"]
            header = Table.grid(padding=(0, 2))
            header.add_row("pipeline", status["pipeline"], "slot", f"{slot['slot']} ({slot.get('wal_status') or 'missing'})",
                           "reader PID", str(slot.get("active_pid") or "-"))
            header.add_row("retained WAL", _bytes(slot.get("retained_wal_bytes")), "unconfirmed",
                           _bytes(slot.get("unconfirmed_bytes")), "lag (last s)", _lag(samples, previous, now))
            tables = Table(Column("table", no_wrap=True), "target (in the warehouse)", Column("applied LSN", no_wrap=True),
                           "applied at", "changes/s", "resync")
            for row in status["tables"]:
                tables.add_row(row["table"], _under(row["target"], config.target.warehouse), row["applied_lsn"] or "-",
                               row["applied_at"] or "-", _rate(samples, previous, now, row["table"]),
                               "pending" if row["resync_pending"] else "")
            live.update(Group(header, tables), refresh=True)
            previous = (now, samples) if samples else previous
            done += 1
            if refreshes is None or done < refreshes:
                sleep(interval)


def _per_second(samples: dict[Any, float], previous: tuple[float, dict[Any, float]] | None, now: float,
                name: str, **labels: str) -> tuple[float, float] | None:
    """(growth of the metric since the previous scrape, seconds since it); None without two scrapes."""
    if not samples or previous is None:
        return None
    then, before = previous
    return _sum(samples, name, **labels) - _sum(before, name, **labels), max(now - then, 1e-3)


def _rate(samples: dict[Any, float], previous: tuple[float, dict[Any, float]] | None, now: float,
          table: str) -> str:
    growth = _per_second(samples, previous, now, "cdc_apply_table_changes_total", table=table)
    return "-" if growth is None else f"{growth[0] / growth[1]:.1f}"


def _lag(samples: dict[Any, float], previous: tuple[float, dict[Any, float]] | None, now: float) -> str:
    count = _per_second(samples, previous, now, "cdc_apply_commit_to_delta_lag_seconds_count")
    total = _per_second(samples, previous, now, "cdc_apply_commit_to_delta_lag_seconds_sum")
    return f"{total[0] / count[0]:.2f} s" if count and total and count[0] else "-"
