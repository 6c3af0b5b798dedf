"""Frames staged as Parquet under the warehouse (``cdc_apply/apply/staging.py``), on the tests' classic
session: the same columns, types and values as ``createDataFrame`` gives, under any column name; each
file gone when its scope ends; a dead process's files swept at the next first staging. The Spark
Connect oracle tests (test_spark_connect.py) stage every frame of two rows or more."""

from __future__ import annotations

import os
import time
from datetime import date, datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_apply.apply import staging as staging_module
from cdc_apply.apply.merge import typed_frame
from cdc_apply.apply.staging import LEFTOVER_SECONDS, Staging, pipeline_staging, staging_scope
from cdc_apply.arrow_nulls import null_array
from cdc_apply.lake.state import PipelineState

pytestmark = pytest.mark.spark


def _table(rows: int) -> pa.Table:
    return pa.table({
        "id": pa.array(range(rows), pa.int64()),
        "a/b": pa.array([i % 3 for i in range(rows)], pa.int16()),  # names no Parquet writer is asked to keep
        "x y.`z`": pa.array([f"text {i}" if i % 4 else None for i in range(rows)], pa.string()),
        "..": pa.array([Decimal(i) / 1000 for i in range(rows)], pa.decimal128(20, 3)),
        "ntz": pa.array([datetime(2024, 2, 29, 23, 59, 59, i) for i in range(rows)], pa.timestamp("us")),
        "tz": pa.array([datetime(1999, 12, 31, 23, i % 60, tzinfo=timezone.utc) for i in range(rows)],
                       pa.timestamp("us", tz="UTC")),
        "day": pa.array([date(1, 1, 1 + i % 28) for i in range(rows)], pa.date32()),
        "list": pa.array([[i, None, -i] if i % 5 else None for i in range(rows)], pa.list_(pa.int32())),
        "never": null_array(rows, pa.list_(pa.string())),
        "image": pa.array([{"k": str(i)} if i % 2 else None for i in range(rows)], pa.map_(pa.string(), pa.string())),
        "nested": pa.array([{"f g": i, "h": [b"\x00\xff"]} for i in range(rows)],
                           pa.struct([("f g", pa.int32()), ("h", pa.list_(pa.binary()))])),
        "real": pa.array([float("nan") if i == 1 else i / 7 for i in range(rows)], pa.float32()),
        "flag": pa.array([i % 2 == 0 for i in range(rows)], pa.bool_()),
    })


def _rows(frame):  # type: ignore[no-untyped-def]
    return sorted((tuple(repr(v) for v in row) for row in frame.collect()), key=lambda r: int(r[0]))


def test_a_staged_frame_equals_the_created_one_and_its_file_goes_with_its_scope(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    staging = pipeline_staging(PipelineState.at(str(tmp_path), "p/1"), min_rows=10)
    folder = tmp_path / "_cdc_apply" / "staging" / "p~2F1"
    table = _table(50)
    created = spark.createDataFrame(table)
    with staging_scope():
        staged = staging.frame(spark, table)
        files = list(folder.glob("*.parquet"))
        assert len(files) == 1
        # Parquet says "no time zone", which Spark reads as timestamp_ntz; createDataFrame on a classic
        # session makes a session-time-zone timestamp of it. The apply casts both to the target's type.
        assert [(f.name, f.dataType) for f in staged.schema.fields] == \
            [(f.name, T.TimestampNTZType() if f.name == "ntz" else f.dataType) for f in created.schema.fields]
        assert _rows(staged.withColumn("ntz", F.col("ntz").cast("timestamp"))) == _rows(created)
        typed = {"ntz": "timestamp_ntz", "..": "decimal(20,3)"}
        assert _rows(typed_frame(spark, dict(zip(table.column_names, table.columns)), typed, staging)) == \
            _rows(typed_frame(spark, dict(zip(table.column_names, table.columns)), typed))
        files = sorted(folder.glob("*.parquet"))
        assert len(files) == 2
        with staging_scope():  # an inner scope deletes its own file only
            assert staging.frame(spark, table).count() == 50
            assert len(list(folder.glob("*.parquet"))) == 3
        assert sorted(folder.glob("*.parquet")) == files
    assert not list(folder.iterdir())

    with staging_scope():  # below the threshold: sent from the driver, no file
        assert _rows(staging.frame(spark, _table(9))) == _rows(spark.createDataFrame(_table(9)))
        assert not list(folder.iterdir())
    off = Staging(min_rows=0)
    assert off.frame(spark, table).count() == 50  # never staged: no scope needed


def test_staging_outside_a_scope_is_refused(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    staging = pipeline_staging(PipelineState.at(str(tmp_path), "p"), min_rows=1)
    with pytest.raises(RuntimeError, match="outside a staging_scope"):
        staging.frame(spark, _table(3))
    assert not (tmp_path / "_cdc_apply" / "staging" / "p").exists() or \
        not list((tmp_path / "_cdc_apply" / "staging" / "p").iterdir())


def test_the_first_staging_of_a_process_sweeps_what_a_dead_one_left(spark, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(staging_module, "_swept", set())
    folder = tmp_path / "_cdc_apply" / "staging" / "p"
    folder.mkdir(parents=True)
    old, recent = folder / "old.parquet", folder / "recent.parquet"
    for path in (old, recent):
        path.write_bytes(b"left by a process that died")
    stale = time.time() - LEFTOVER_SECONDS - 60
    os.utime(old, (stale, stale))
    staging = pipeline_staging(PipelineState.at(str(tmp_path), "p"), min_rows=1)
    with staging_scope():
        assert staging.frame(spark, _table(2)).count() == 2
        assert not old.exists() and recent.exists()  # a file a live command may still read stays
    old.write_bytes(b"again")
    os.utime(old, (stale, stale))
    with staging_scope():  # once per process: not swept again
        staging.frame(spark, _table(2)).count()
    assert sorted(p.name for p in folder.iterdir()) == ["old.parquet", "recent.parquet"]
