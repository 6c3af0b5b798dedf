"""A benchmark's figures as a JSON report (`cdc-apply bench NAME --report FILE`), and the page of
latest figures made from the committed reports (`python -m cdc_apply.bench.report`).

A report holds the bench's name and arguments, every figure it returned, the goals it is judged
against, the machine, the date and the commit. ``docs/benchmarks.md`` shows the newest report of
each bench between its two markers; a test requires that section to be what the committed reports
in ``docs/bench-results/`` give, so the page is never typed by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "bench-results"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
BEGIN, END = "<!-- latest reports: begin -->", "<!-- latest reports: end -->"

# The figures each bench is judged by, and their goals (docs/benchmarks.md explains each).
GOALS: dict[str, dict[str, str]] = {
    "decode": {"ratio_change_rows_to_delivery": ">= 1.0"},
    "e2e": {"lag_p99_s": "<= 5", "ratio_catchup_to_delivery": ">= 0.4", "ratio_capacity_to_delivery": ">= 0.25"},
    "apply": {"merge_over_append": "<= 3", "merge_rss_mb": "<= 1024"},
    "memory": {"peak_rss_mb": "< 500"},
    "soak": {"worst_batch_ratio": "<= 1.5"},
    "failover": {"slowest_pipeline_s": "< 10"},
    "snapshot": {"product_over_raw": ">= 0.25", "product_over_spark": ">= 3"},
    "restart": {"applied_s": "<= 3"},
    "crash": {"lost": "== 0", "applied_twice": "== 0", "problems_after_kills": "== 0", "tables_differing": "== 0"},
    "stream": {},
}


def derived(name: str, figures: Any) -> dict[str, Any]:
    """Figures a goal judges that the bench's own result holds only in parts."""
    if name == "apply" and isinstance(figures, Mapping) and figures.get("append_s"):
        return {"merge_over_append": figures["merge_apply_s"] / figures["append_s"]}
    if name == "failover" and isinstance(figures, list) and figures:
        rounds = [_plain(times) for times in figures]
        return {"rounds": rounds, "slowest_pipeline_s": max(r["reconnect_s"] + r["apply_s"] for r in rounds)}
    return {}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    memory_kb = 0
    model = platform.processor()
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            memory_kb = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cores": os.cpu_count(), "memory_gib": round(memory_kb / 2**20, 1), "cpu": model,
            "system": platform.platform(), "python": platform.python_version()}


def _commit() -> str | None:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent, check=False)
    except OSError:
        return None
    return found.stdout.strip() or None


def _plain(figures: Any) -> Any:
    """The figures as JSON values: a list of dataclasses (the failover rounds) as a list of objects."""
    if dataclasses.is_dataclass(figures) and not isinstance(figures, type):
        return dataclasses.asdict(figures)
    if isinstance(figures, Mapping):
        return {str(key): _plain(value) for key, value in figures.items()}
    if isinstance(figures, (list, tuple)):
        return [_plain(value) for value in figures]
    return figures


def report(name: str, arguments: Mapping[str, Any], figures: Any) -> dict[str, Any]:
    plain = _plain(figures) if isinstance(figures, Mapping) else {}
    return {"bench": name, "arguments": dict(arguments), "figures": {**plain, **derived(name, figures)},
            "goals": GOALS.get(name, {}),
            "machine": machine(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit()}


def write_report(path: str, name: str, arguments: Mapping[str, Any], figures: Any) -> None:
    Path(path).write_text(json.dumps(report(name, arguments, figures), indent=2, sort_keys=True) + "\n",
                          encoding="utf-8")


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def render(reports: Iterable[Mapping[str, Any]]) -> str:
    """The newest report of each bench: its judged figures beside their goals, the date and machine."""
    newest: dict[str, Mapping[str, Any]] = {}
    for found in sorted(reports, key=lambda r: str(r["date"])):
        newest[str(found["bench"])] = found
    lines = ["| bench | arguments | figure | measured | goal | date, commit | machine |", "|---|---|---|---|---|---|---|"]
    for name in sorted(newest):
        found = newest[name]
        figures = found["figures"] if isinstance(found["figures"], Mapping) else {}
        goals = found["goals"] or {key: "—" for key in list(figures)[:3]}
        arguments = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(found["arguments"].items()))
        host = found["machine"]
        for key, goal in goals.items():
            lines.append(f"| `{name}` | {arguments} | `{key}` | {_number(figures.get(key, '—'))} | {goal} | "
                         f"{str(found['date'])[:10]}, {found['commit'] or '?'} | "
                         f"{host['cores']} cores, {host['memory_gib']} GiB |")
    return "\n".join(lines)


def committed_reports(folder: Path = RESULTS) -> list[dict[str, Any]]:
    return [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))]


def page_section(page: str, reports: Iterable[Mapping[str, Any]]) -> str:
    """``page`` with the part between its markers made anew from ``reports``."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + render(reports) + "\n" + page[end:]


def main() -> int:
    PAGE.write_text(page_section(PAGE.read_text(encoding="utf-8"), committed_reports()), encoding="utf-8")
    print(f"{PAGE}: the latest figures of {len(committed_reports())} report(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
