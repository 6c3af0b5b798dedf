"""Each `cdc-apply bench` verb runs for real at a small size and reports its side-by-side figures.
(The figures themselves are for the closing notes, not asserted: speed is not a test here.)
The verbs that need Spark run in this process on the shared session, as ``bench snapshot`` does;
``bench memory`` measures a child process of its own, and ``bench decode`` goes through the CLI."""

from __future__ import annotations

import json

import re

import pytest

from cdc_apply.bench.apply import bench_apply
from cdc_apply.bench.e2e import bench_e2e
from cdc_apply.bench.snapshot import bench_snapshot
from cdc_apply.bench.soak import bench_soak
from cdc_apply.bench.stream import bench_stream
from tests.test_decode_cli import _cli


def _ratio(output: str, label: str) -> float:
    match = re.search(label + r".*?ratio ([0-9.]+)x", output)
    assert match, output[-3000:]
    return float(match.group(1))


@pytest.mark.pg
def test_bench_decode_reports_its_ratio_to_walsender_delivery(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report = tmp_path / "decode.json"
    run = _cli("bench", "decode", "--messages", "3000", "--rounds", "1", "--report", str(report))
    assert run.returncode == 0, run.stderr[-3000:]
    # The JSON report: the arguments, every figure, the goals, the machine, the date and the commit.
    written = json.loads(report.read_text())
    assert written["bench"] == "decode" and written["arguments"] == {"messages": 3000, "binary": False, "rounds": 1,
                                                                     "load": False}
    assert written["figures"]["ratio_change_rows_to_delivery"] > 0 and written["figures"]["messages"] > 2000
    assert written["goals"] == {"ratio_change_rows_to_delivery": ">= 1.0"}
    assert written["machine"]["cores"] >= 1 and written["date"].startswith("20") and written["commit"]
    assert _ratio(run.stdout, "decode \\+ assemble") > 0
    assert _ratio(run.stdout, "change rows as Arrow") > 0 and _ratio(run.stdout, "rows as Python values") > 0
    assert _ratio(run.stdout, "the same, a backlog.s batches") > 0
    per_change = re.search(r"per change: assembly ([0-9.]+) us read at a time, ([0-9.]+) us message by message "
                           r"\(([0-9.]+)x\); of it, the frames split ([0-9.]+) us", run.stdout)
    assert per_change, run.stdout[-3000:]
    read_at_a_time, by_message, _, split = map(float, per_change.groups())
    assert read_at_a_time > split > 0 and by_message > 0
    stages = re.search(r"per change, stage by stage: receive \(the loop's CPU\) ([0-9.]+) us, split ([0-9.]+) us, "
                       r"decode \+ assemble ([0-9.]+) us, the targets' change rows ([0-9.]+) us, "
                       r"the log's rows ([0-9.]+) us", run.stdout)
    assert stages, run.stdout[-3000:]
    assert all(float(value) > 0 for value in stages.groups())
    assert float(stages.group(2)) == split
    # The e2e load's shape: small transactions over four tables.
    loaded = _cli("bench", "decode", "--load", "--messages", "3000", "--rounds", "1")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "(text mode, the e2e load)" in loaded.stdout and "per change, stage by stage: receive" in loaded.stdout, \
        loaded.stdout[-3000:]


@pytest.mark.spark
def test_bench_apply_reports_merge_against_append(spark, capsys) -> None:  # type: ignore[no-untyped-def]
    bench_apply(rows=2000, changes=500, per_transaction_slice=200, spark=spark)
    output = capsys.readouterr().out
    assert re.search(r"ratio MERGE apply / append:\s+[0-9.]+x", output), output[-3000:]
    assert re.search(r"from a cached DataFrame: [0-9.]+ s; ratio MERGE apply / that: [0-9.]+x", output)
    assert re.search(r"row-by-row collapse of the same changes to its MERGE source: [0-9.]+ s", output)
    assert re.search(r"the public path's checked append [0-9.]+ s \([0-9.]+x Delta's internal unchecked one\)", output)
    assert re.search(r"a MERGE's median with the key filter [0-9.]+ s, without [0-9.]+ s \([0-9.]+x\)", output), \
        output[-3000:]


@pytest.mark.spark
@pytest.mark.pg
def test_bench_e2e_reports_lag_and_catch_up_with_and_without_the_log(spark, capsys) -> None:  # type: ignore[no-untyped-def]
    bench_e2e(seconds=3, rate=10, capacity_steps=1, changelog=True, spark=spark)
    output = capsys.readouterr().out
    assert re.search(r"commit -> change log lag p50 [0-9.]+ s, p99 [0-9.]+ s \(goal p99 <= 2 s\); commit -> target "
                     r"lag p50 [0-9.]+ s, p99 [0-9.]+ s \(without: p50", output), output[-3000:]
    confirmed = re.search(r"confirmed catch-up +ratio ([0-9.]+)x of the walsender's delivery .* the targets "
                          r"([0-9.]+)x \(without the log: [0-9.]+x\)", output)
    assert confirmed and float(confirmed[1]) >= float(confirmed[2]) > 0, output[-3000:]
    assert re.search(r"lag p50 [0-9.]+ s, p99 [0-9.]+ s \(the first run, in a new JVM: p99 [0-9.]+ s\)",
                     output), output[-3000:]
    assert _ratio(output, "pipeline catch-up") > 0
    # The driver's CPU per change, without the log and until confirmed with it: the loop's thread is a
    # part of the process's CPU.
    # The kernel's share is a part of it too, and a catch-up touches new memory.
    cpu = re.findall(r"driver CPU per change +([0-9.]+) us .* of it the replication loop's thread ([0-9.]+) us; "
                     r"system time ([0-9.]+) us, ([0-9.]+) minor page faults per change", output)
    assert len(cpu) == 2 and all(float(driver) >= float(loop) > 0 and float(driver) >= float(system)
                                 and float(faults) > 0 for driver, loop, system, faults in cpu), output[-3000:]
    assert re.search(r"capacity step 1: 2 x 10 tx/s -> [0-9,]+ changes/s, lag p99 [0-9.]+ s", output)
    assert re.search(r"capacity \(p99 <= 10 s\) +[0-9,]+ changes/s +ratio [0-9.]+x", output), output[-2000:]


@pytest.mark.spark
@pytest.mark.pg
def test_bench_memory_reports_the_peak_rss_of_a_large_streamed_transaction() -> None:
    """The update variant under ``confirm_after: changelog``: the slot confirmed at the log, then the
    targets' MERGE from the log (the insert-only pieces: test_large_transactions.py)."""
    run = _cli("bench", "memory", "--megabytes", "10", "--updates", "--changelog")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "one transaction that updates every row and deletes a tenth of 10,485 rows" in run.stdout
    confirmed = re.search(r"slot confirmed \(the change log holds it\) in ([0-9.]+) s", run.stdout)
    applied = re.search(r"applied in ([0-9.]+) s \(merge, columnar\)", run.stdout)
    assert confirmed and applied and float(applied[1]) >= float(confirmed[1]) > 0, run.stdout[-3000:]
    peak = re.search(r"peak RSS: Python driver ([0-9,]+) MB \(before the transaction ([0-9,]+) MB", run.stdout)
    assert peak and int(peak[1].replace(",", "")) >= int(peak[2].replace(",", "")) > 0, run.stdout[-3000:]


@pytest.mark.spark
@pytest.mark.pg
def test_bench_soak_reports_batch_times_over_time_and_the_files(spark, capsys) -> None:  # type: ignore[no-untyped-def]
    bench_soak(minutes=0.3, rate=10, spark=spark)
    output = capsys.readouterr().out
    assert re.search(r"public.accounts +batch apply median: first minute [0-9.]+ s, last minute [0-9.]+ s, "
                     r"ratio [0-9.]+x", output), output[-3000:]
    files = re.search(r"public.ledger +([0-9,]+) rows in +([0-9]+) files, log version ([0-9]+), whole-table read "
                      r"[0-9.]+ s \(Spark\), [0-9.]+ s \(delta-rs, ([0-9,]+) rows\)", output)
    assert files, output[-3000:]
    assert int(files[1].replace(",", "")) > 0 and files[1] == files[4]  # both readers saw every row


@pytest.mark.spark
@pytest.mark.pg
def test_bench_stream_compares_the_streaming_query_with_follow(spark, capsys) -> None:  # type: ignore[no-untyped-def]
    bench_stream(seconds=3, rate=10, spark=spark)
    output = capsys.readouterr().out
    for label in ("run --follow", "streaming query"):
        line = next(line for line in output.splitlines() if line.strip().startswith(label))
        assert re.search(r"lag p50 [0-9.]+ s, p99 [0-9.]+ s; catch-up +[0-9,]+ changes/s, ratio to delivery [0-9.]+x",
                         line), line
    assert re.search(r"streaming query / run --follow: steady [0-9.]+x, catch-up [0-9.]+x", output)


@pytest.mark.spark
@pytest.mark.pg
def test_bench_snapshot_times_five_copies_of_the_same_rows(spark, capsys) -> None:  # type: ignore[no-untyped-def]
    """In-process, on the shared session: each copy must hold every row (the bench checks the counts)."""
    result = bench_snapshot(rows=3000, spark=spark, snapshot={"range_pages": 16}, changelog=True)  # 3000 rows: 4 ranges
    report = capsys.readouterr().out
    assert "cdc_apply's copy: Spark's tasks, page ranges; Python driver RSS" in report, report
    for line in ("raw COPY read", "hand-written Spark copy", "cdc_apply's copy", "with Delta's writer",
                 "cdc_apply ÷ raw COPY read", "cdc_apply ÷ hand-written Spark copy",
                 "files written by the tasks ÷ by Delta's writer", "with the change log ÷ without"):
        assert line in report, report
    assert "round 2:" in report and report.count("cdc_apply ÷ raw COPY read") == 2, report
    assert result["product_over_raw"] > 0 and result["product_over_spark"] > 0 and result["driver_peak_rss_mb"] > 50
    assert result["first_product_over_raw"] > 0 and result["first_product_over_spark"] > 0
    assert result["tasks_over_delta_writer"] > 0 and result["logged_over_tasks"] > 0


