"""Airflow: one bounded batch in SQL-interface mode (`run --once`) as a task, its summary to XCom.

Two ways in, both needing only ``pip install 'cdc_apply[airflow]'``:
- TaskFlow: call ``run_batch(config_path)`` inside ``@task``; the returned dict goes to XCom.
- Classic: ``CdcApplyOperator(task_id=..., config_path=...)``.

The task reads what the slot holds when it starts, applies it, confirms it, and returns. Running it
again after a failure is safe: the slot was not confirmed past what Delta holds, and Delta's
transaction versions skip what was applied but not confirmed.
"""

from __future__ import annotations

import time
from typing import Any

from cdc_apply.lsn import format_lsn


def run_batch(config_path: str, spark_conf: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply what the slot holds now; returns a JSON-ready summary (tables, counts, LSN range, lag)."""
    from cdc_apply.spark import build_spark_session
    from cdc_apply.config import load_config
    from cdc_apply.pipeline import drain
    from cdc_apply.replay import table_totals

    config = load_config(config_path)
    spark = build_spark_session({**config.spark, **(spark_conf or {})}, register_pgoutput=False)
    started = time.time()
    summary = drain(config, spark)
    totals, _ = table_totals(summary.batches)
    tables = {name: {op: counts[op] for op in "IUDT"} for name, counts in totals.items()}
    changes = sum(batch.changes for batch in summary.batches)
    seconds = time.time() - started
    lsns = [b.last_lsn for b in summary.batches if b.last_lsn] + [b.first_lsn for b in summary.batches if b.first_lsn]
    return {
        "pipeline": config.pipeline,
        "slot": config.source.slot,
        "batches": len(summary.batches),
        "changes": changes,
        "changes_per_s": round(changes / seconds, 1) if seconds else 0.0,
        "tables": tables,
        "snapshots": {s.table: s.rows for s in summary.snapshots},
        "first_lsn": format_lsn(min(lsns)) if lsns else None,
        "last_lsn": format_lsn(max(lsns)) if lsns else None,
        "confirmed_lsn": format_lsn(summary.confirmed_lsn) if summary.confirmed_lsn else None,
        "lag_p50_s": round(summary.lag_percentile(0.5) or 0.0, 2),
        "lag_p99_s": round(summary.lag_percentile(0.99) or 0.0, 2),
        "seconds": round(seconds, 1),
    }


def __getattr__(name: str) -> Any:
    """``CdcApplyOperator`` is built on first use, so importing this module never needs Airflow."""
    if name != "CdcApplyOperator":
        raise AttributeError(name)
    from airflow.sdk import BaseOperator

    class CdcApplyOperator(BaseOperator):  # type: ignore[misc]
        template_fields = ("config_path",)

        def __init__(self, *, config_path: str, spark_conf: dict[str, str] | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.config_path = config_path
            self.spark_conf = spark_conf

        def execute(self, context: Any) -> dict[str, Any]:
            return run_batch(self.config_path, self.spark_conf)

    globals()["CdcApplyOperator"] = CdcApplyOperator
    return CdcApplyOperator
