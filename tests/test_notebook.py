"""The replay notebook runs top to bottom in a real Jupyter kernel (nbclient) and lands real Delta tables.

It runs once, as the hardest place a user runs it: its session a Spark Connect client of a server the
test starts, and its warehouse on a real S3 server (versitygw). The replay of the capture, the
streaming query and the change log's rebuild all land in the bucket. Its local default (a classic
session, a local directory) is the same cells: the classic session runs the same library calls in
every other Spark test (docs/testing.md, "The notebook")."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import nbformat
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from nbclient import NotebookClient

from cdc_apply.lake.location import Location, Storage

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "replay_captured_batch.ipynb"


def _text(cell) -> str:  # type: ignore[no-untyped-def]
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.spark
@pytest.mark.pg
def test_replay_notebook_executes_on_a_connect_session_into_a_bucket(tmp_path, monkeypatch, spark,  # type: ignore[no-untyped-def]
                                                                  connect_with_s3) -> None:
    """As a notebook on Databricks serverless or a shared cluster runs it: a Spark Connect client, the
    warehouse on object storage (the server reaches the bucket; the notebook's own reads and delta-rs
    reach it with the same settings). The server is the worker's (tests/conftest.py)."""
    connect, s3 = connect_with_s3
    s3.create_bucket("notebook")
    for key, value in s3.spark_conf().items():  # this session reads the bucket too
        spark.conf.set(key.removeprefix("spark.hadoop."), value)
    execute_and_check(tmp_path, monkeypatch, spark, {"spark.remote": connect.url, **s3.spark_conf()},
                      s3.storage(), "s3a://notebook/lake")
    assert (s3.root / "notebook" / "lake" / "public" / "customers" / "_delta_log").is_dir()  # in the bucket
    assert not any(p.name.startswith("s3a") for p in Path(tmp_path).rglob("*"))


def execute_and_check(tmp_path, monkeypatch, spark, spark_conf: dict[str, str], storage: Storage,  # type: ignore[no-untyped-def]
                      lake: str) -> None:
    """The notebook run with ``spark_conf`` (its session's settings) writing into ``lake``; ``spark``
    and delta-rs (through ``storage``) check what it wrote."""
    monkeypatch.setenv("CDC_APPLY_WAREHOUSE", lake)
    monkeypatch.setenv("CDC_APPLY_SPARK_CONF", json.dumps(spark_conf))
    monkeypatch.delenv("CDC_APPLY_CAPTURE", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not any(o.get("output_type") == "error" for o in cell.get("outputs", [])) for cell in code)
    outputs = "\n".join(_text(cell) for cell in code)
    assert "captured" in outputs and "public.customers" in outputs
    capture = re.search(r"^capture: (\S+)", outputs, re.M)
    assert capture is not None, outputs[:2000]
    shutil.rmtree(Path(capture[1]).parent)  # the notebook's own capture directory, made in /tmp
    kind = "Spark Connect" if "spark.remote" in spark_conf else "classic"
    assert re.search(rf"^Spark 4\.\S+ session: {kind}$", outputs, re.M), outputs[:2000]
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
    by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(
        storage.delta_rs_uri(rebuilt_location), storage_options=storage.delta_rs_options(rebuilt_location)).scan(
        columns=source_columns)).read_all()  # a second Delta reader, from the bucket
    assert sorted(by_delta_rs.to_pylist(), key=lambda row: row["id"]) == \
        [row.asDict() for row in rebuilt.orderBy("id").collect()]
    assert re.search(r"customers as of [0-9A-F]+/[0-9A-F]+: \[1, 20\]", outputs), outputs[-2000:]
    assert storage.names(Location.parse(lake).child("as_of", "public")) == ["customers"]  # one table as of an LSN
    assert "_delta_log" in storage.names(Location.parse(lake).child("public", "customers"))
