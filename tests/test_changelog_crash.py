"""Crash safety of ``changelog.confirm_after: changelog`` (`cdc-apply run --follow`): kill -9 at 20
random points under a concurrent load, restart each time.

After every kill: each transaction whose commit the slot's confirmed position covers is in the
change log (the slot is confirmed at the log, not at the targets), and the log holds no
transaction twice. At the end every target equals PostgreSQL, and the insert-only ``journal``
table shows that nothing was applied twice.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_apply.apply.delta_log import writer_versions
from cdc_apply.bench.load import Load, create_schema
from cdc_apply.changelog_apply import AppliedPosition
from cdc_apply.sources.slot import wait_until_caught_up
from tests.test_crash import Job, _confirmed, crash_config, kill_at_random_points
from tests.test_live import assert_delta_equals_postgres


def _log(warehouse: str, columns: list[str]) -> pa.Table:
    path = Path(warehouse) / "_cdc_apply" / "changelog"
    if not (path / "_delta_log").exists():
        return pa.table({name: pa.array([], pa.int64()) for name in columns})
    return pa.RecordBatchReader.from_stream(DeltaTable(str(path)).scan(columns=columns)).read_all()


def _assert_confirmed_is_in_the_log(conn: psycopg.Connection, load: Load, warehouse: str) -> None:
    """Read by delta-rs, without Spark: every ledger insert the slot's position covers is in the log,
    and no change is in it twice."""
    confirmed = _confirmed(conn)
    covered = {seq for seq, lsn in dict(load.ledger_lsns).items() if lsn <= confirmed}
    rows = _log(warehouse, ["commit_lsn", "xid", "seq", "relation_oid", "table", "op", "new"])
    identities = list(zip(*(rows.column(c).to_pylist() for c in ("commit_lsn", "xid", "seq", "relation_oid"))))
    assert len(identities) == len(set(identities)), "the change log holds a change twice"
    logged = {int(dict(new)["seq"]) for table, op, new in
              zip(*(rows.column(c).to_pylist() for c in ("table", "op", "new"))) if table == "ledger" and op == "I"}
    missing = covered - logged
    assert not missing, f"slot confirmed past {len(missing)} transactions the change log does not hold: " \
                        f"{sorted(missing)[:5]}"


def _wait_until_the_targets_hold_the_log(warehouse: str, timeout: float) -> None:
    log_version = writer_versions(Path(warehouse) / "_cdc_apply" / "changelog")["crash/changelog"].version
    position = AppliedPosition(warehouse, "crash")
    deadline = time.monotonic() + timeout
    while (position.read() or 0) < log_version:
        assert time.monotonic() < deadline, f"the targets did not catch up with the change log in {timeout} s"
        time.sleep(0.5)


@pytest.mark.timeout(2400)
def test_kill_9_with_the_slot_confirmed_at_the_change_log(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    config, warehouse, log = crash_config(tmp_path, conninfo, batching={"max_seconds": 0.5, "max_changes": 20000},
                                          changelog={"enabled": True, "confirm_after": "changelog"})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute("SELECT pg_create_logical_replication_slot('crash', 'pgoutput')")
        load = Load(conninfo, sessions=2, rate_per_session=2, big_every=200).start()
        try:
            kill_at_random_points(conn, load, warehouse, lambda kill: Job(config, log), random.Random(17),
                                  check=_assert_confirmed_is_in_the_log)
        finally:
            load.finish()
        job = Job(config, log)
        try:
            wait_until_caught_up(conninfo, "crash", timeout=600)
            _wait_until_the_targets_hold_the_log(warehouse, timeout=600)
        finally:
            job.process.send_signal(signal.SIGTERM)
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert load.committed > 100
        _assert_confirmed_is_in_the_log(conn, load, warehouse)
        assert_delta_equals_postgres(spark, conn, warehouse)
