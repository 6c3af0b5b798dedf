"""Example Airflow DAG: every 15 minutes, apply what the slot holds to Delta (one bounded batch).

Put this file in your DAGs folder and point CDC_APPLY_CONFIG at your YAML config (or edit
CONFIG below). The task's return value (tables, I/U/D/T counts, LSN range, changes/s) goes to XCom.
The task is the classic ``CdcApplyOperator``; in a TaskFlow DAG, call
``cdc_apply.airflow.run_batch(config_path)`` inside ``@task`` instead (the operator calls it too).
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import dag

from cdc_apply.airflow import CdcApplyOperator

CONFIG = os.environ.get("CDC_APPLY_CONFIG", "conf/example.yaml")


@dag(dag_id="cdc_apply", schedule="*/15 * * * *", start_date=datetime(2026, 1, 1), catchup=False,
     max_active_runs=1, tags=["cdc", "delta"])
def cdc_apply_dag() -> None:
    CdcApplyOperator(task_id="apply_changes", config_path=CONFIG, retries=3)


dag_object = cdc_apply_dag()
