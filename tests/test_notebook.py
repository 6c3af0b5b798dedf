"""The replay notebook runs top to bottom in a real Jupyter kernel (nbclient) and lands real Delta tables.

It runs once, with its config cell pointed at a warehouse on a real S3 server (versitygw): the replay
of the capture, the streaming query and the change log's rebuild all land in the bucket. Its local
default is the same code with a local directory for ``Location``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from nbclient import NotebookClient

from cdc_apply.lake.location import Location
from cdc_apply.s3server import S3Server

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "replay_captured_batch.ipynb"


def _text(cell) -> str:  # type: ignore[no-untyped-def]
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.spark
@pytest.mark.pg
def test_replay_notebook_executes_and_writes_delta(tmp_path, monkeypatch, spark) -> None:  # type: ignore[no-untyped-def]
    with S3Server() as s3:
        s3.create_bucket("notebook")
        for key, value in s3.spark_conf().items():  # this session reads the bucket too
            spark.conf.set(key.removeprefix("spark.hadoop."), value)
        _execute_and_check(tmp_path, monkeypatch, spark, s3, "s3a://notebook/lake")


def _execute_and_check(tmp_path, monkeypatch, spark, s3: S3Server, lake: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CDC_APPLY_WAREHOUSE", lake)
    monkeypatch.setenv("CDC_APPLY_SPARK_CONF", json.dumps(s3.spark_conf()))
    monkeypatch.delenv("CDC_APPLY_CAPTURE", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not any(o.get("output_type") == "error" for o in cell.get("outputs", [])) for cell in code)
    outputs = "\n".join(_text(cell) for cell in code)
    assert "captured" in outputs and "public.customers" in outputs
    # The whole capture is one batch into a new table: every key of customers arrives first as an
    # insert, so the batch is appended (docs/apply.md, "Batches of new rows").
    assert re.search(r'\|\s*WRITE\|\{"cdc_apply": "append"', outputs)
    assert any(o.get("data", {}).get("image/png") for cell in code for o in cell.get("outputs", []))
    customers = spark.read.format("delta").load(f"{lake}/public/customers")
    assert sorted(r["id"] for r in customers.collect()) == [1, 3]  # the demo workload's final state
    # Sections 6-7: the data source reads the capture, and a streaming query lands the same final table.
    assert "batch 0:" in outputs
    assert "struct<id:int," in outputs  # the typed read of one table (option "table")
    streamed = spark.read.format("delta").load(f"{lake}/streamed/public/customers")
    assert sorted(r["id"] for r in streamed.collect()) == [1, 3]
    # Section 8: the change log, and tables rebuilt from it alone (whole, and one as of an LSN).
    assert re.search(r"^\d+ change rows in the change log$", outputs, re.M)
    rebuilt = spark.read.format("delta").load(f"{lake}/rebuilt/public/customers")
    logged = spark.read.format("delta").load(f"{lake}/logged/public/customers")
    # The live targets were copied at the end of the workload, the rebuilt ones made of its changes:
    # the same rows; the metadata columns (the LSNs) and the column order differ.
    source_columns = ["id", "name", "email", "notes", "tier"]
    rebuilt, logged = rebuilt.select(*source_columns), logged.select(*source_columns)
    assert rebuilt.exceptAll(logged).count() == 0 and logged.exceptAll(rebuilt).count() == 0
    assert sorted(r["id"] for r in rebuilt.collect()) == [1, 3]
    rebuilt_location = Location.parse(f"{lake}/rebuilt/public/customers")
    storage = s3.storage()
    by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(
        storage.delta_rs_uri(rebuilt_location), storage_options=storage.delta_rs_options(rebuilt_location)).scan(
        columns=source_columns)).read_all()  # a second Delta reader, from the bucket
    assert sorted(by_delta_rs.to_pylist(), key=lambda row: row["id"]) == \
        [row.asDict() for row in rebuilt.orderBy("id").collect()]
    assert re.search(r"customers as of [0-9A-F]+/[0-9A-F]+: \[1, 20\]", outputs), outputs[-2000:]
    assert not (s3.root / "notebook" / "lake" / "as_of" / "public" / "orders").exists()
    assert (s3.root / "notebook" / "lake" / "public" / "customers" / "_delta_log").is_dir()  # in the bucket
    assert not any(p.name.startswith("s3a") for p in Path(tmp_path).rglob("*"))
