"""The change log (``changelog.enabled``, ``cdc_apply/changelog.py``) against a real server: every
batch's change rows appended once, beside the targets; targets rebuilt from it alone in another
warehouse equal PostgreSQL and the live targets; a replay is idempotent; another pipeline's log,
and targets ahead of the log, are refused with the place named."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from cdc_apply.apply.options import apply_options
from cdc_apply.apply.targets import Target
from cdc_apply.bench.load import TABLES, Load, create_schema
from cdc_apply.changelog import ChangeLog, ChangeLogError
from cdc_apply.transactions import Transaction
from cdc_apply.lake.state import PipelineState
from cdc_apply.changelog.applier import AppliedPosition, transaction_windows
from cdc_apply.changelog.follower import BACKLOG_LAG_S, BACKLOG_QUIET_S, BACKLOG_YIELD_S, shows_a_backlog, still_yielding
from cdc_apply.cli import build_parser
from cdc_apply.follow_changelog import start_changelog_stream
from cdc_apply.config import ConfigError, parse_config
from cdc_apply.live import BackgroundReplicator
from cdc_apply.lsn import PG_EPOCH_OFFSET_US, format_lsn, parse_lsn
from cdc_apply.pipeline import drain, prepare_source
from cdc_apply.replay import replay_changelog
from cdc_apply.resync import published_oids, resync
from cdc_apply.runtime import StopFlag
from cdc_apply.status import pipeline_status
from cdc_apply.stream_job import run_stream
from tests.delta_oracle import delta_rows, file_statistics, parquet_writers, source_types
from tests.reference_apply import postgres_rows
from tests.test_decode_cli import _cli, _cli_here
from tests.test_live import assert_delta_equals_postgres


def _config(conninfo: str, warehouse: str, pipeline: str = "logged", **changelog: object):  # type: ignore[no-untyped-def]
    return parse_config({"pipeline": pipeline, "source": {"dsn": conninfo, "slot": pipeline, "publication": "load"},
                         "target": {"warehouse": warehouse}, "batching": {"max_changes": 300},
                         "changelog": {"enabled": True, **changelog}})


def _trim(*arguments: str) -> int:
    """``cdc-apply trim-changelog`` in this process (its Spark session), without the CLI's logging setup."""
    args = build_parser().parse_args(["trim-changelog", *arguments])
    return int(args.handler(args))


def test_a_rebuild_from_the_change_log_equals_postgres_and_the_live_targets(db18, spark, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = _config(conninfo, warehouse)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")  # empty tables: every row arrives as a change, so the log holds them all
        drain(config, spark)  # the slot, the (empty) copies, the log
        load = Load(conninfo, sessions=2, rate_per_session=10, big_every=40).start()
        try:
            time.sleep(3)
            first = drain(config, spark)  # several batches of at most 300 changes, under the load
            time.sleep(2)
        finally:
            load.finish()
        second = drain(config, spark)
        assert first.changelog_rows > 0 and second.changelog_rows > 0
        assert_delta_equals_postgres(spark, conn, warehouse)

        changelog = ChangeLog(spark, config)
        rows = changelog.read()
        # Each change once: no transaction appended twice, though the drains re-read the slot's last window.
        assert rows.groupBy("commit_lsn", "xid", "seq", "relation_oid").count().where("count > 1").count() == 0
        assert rows.where("xid != 0").count() == first.changelog_rows + second.changelog_rows
        assert rows.where("xid = 0 AND op = 'T'").count() == rows.where("xid = 0").count() == len(TABLES)  # empty copies
        assert changelog.version == rows.agg({"commit_lsn": "max"}).collect()[0][0]
        # The driver wrote the log's files itself (apply/files.py): one table's rows per partition
        # directory, each file with the bounds of its commit LSNs, which an LSN range skips files by.
        location = changelog.target.location
        assert parquet_writers(location) == {"parquet-cpp-arrow"}
        oids = {r.relation_oid for r in rows.select("relation_oid").distinct().collect()}
        assert {p.name for p in Path(location).iterdir() if p.name.startswith("relation_oid=")} == \
            {f"relation_oid={oid}" for oid in oids}
        stats = file_statistics(location)
        assert sum(s["numRecords"] for s in stats) == rows.count()
        assert all(s["minValues"]["commit_lsn"] <= s["maxValues"]["commit_lsn"] for s in stats)
        # delta-rs reads the same rows.
        by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(location).scan()).read_all()
        keys = ("commit_lsn", "xid", "seq", "relation_oid")
        assert sorted(zip(*(by_delta_rs[k].to_pylist() for k in keys))) == \
            sorted(tuple(r) for r in rows.select(*keys).collect())

        rebuilt = str(tmp_path / "rebuilt")
        options = replace(apply_options(config), warehouse=rebuilt)
        results = replay_changelog(spark, config, options, max_changes=500)
        assert len(results) > 1  # windows of whole transactions
        assert_delta_equals_postgres(spark, conn, rebuilt)
        for name in ("accounts", "ledger"):  # the same rows as the live targets, metadata columns too
            live, again = (Target(spark, f"{w}/public/{name}", False).read() for w in (warehouse, rebuilt))
            assert live.exceptAll(again).count() == 0 and again.exceptAll(live).count() == 0
        again = replay_changelog(spark, config, options)
        assert all(t.skipped for batch in again for t in batch.tables)  # idempotent

        # One table as of an LSN: only its changes up to there.
        middle = sorted(r.commit_lsn for r in rows.select("commit_lsn").distinct().collect())[10]
        partial = replace(apply_options(config), warehouse=str(tmp_path / "partial"))
        applied = {t.table for batch in replay_changelog(spark, config, partial, table="public.accounts",
                                                         until_lsn=middle) for t in batch.tables}
        assert applied == {"public.accounts"}
        accounts = Target(spark, str(tmp_path / "partial" / "public" / "accounts"), False)
        oid = conn.execute("SELECT 'accounts'::regclass::oid").fetchone()[0]
        assert accounts.committed_version(f"logged/{oid}") <= middle
        assert not (tmp_path / "partial" / "public" / "ledger").exists()

        # A table added with rows: its copy's rows are in the log too, so it rebuilds from the log alone.
        conn.execute("CREATE TABLE seeded (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO seeded SELECT g, 'v' || g FROM generate_series(1, 3) g")
        conn.execute("ALTER PUBLICATION load ADD TABLE seeded")
        assert [s.rows for s in drain(config, spark).snapshots] == [3]
        seeded_oid = conn.execute("SELECT 'seeded'::regclass::oid").fetchone()[0]
        assert changelog.copies()[seeded_oid].rows == 3 and changelog.copies()[seeded_oid].logged
        assert replay_changelog(spark, config, replace(apply_options(config), warehouse=str(tmp_path / "seeded")),
                                table="public.seeded")
        assert delta_rows(spark, str(tmp_path / "seeded" / "public" / "seeded"), ["id", "v"],
                          source_types(conn, "public.seeded")) == postgres_rows(conn, "public.seeded", ["id", "v"])
        # Into the live warehouse, whose target holds the copy, it is not refused (its version, the
        # copy's, is past the log's last transaction, and was once taken for a target ahead of the log).
        replay_changelog(spark, config, options=apply_options(config), table="public.seeded")

        # Another pipeline's log, and targets ahead of the log, are refused.
        other = _config(conninfo, warehouse, pipeline="other", path=changelog.target.location)
        with pytest.raises(ChangeLogError, match="is the change log of pipeline 'logged', not 'other'"):
            ChangeLog(spark, other).ensure()
        fresh_log = _config(conninfo, warehouse, path=str(tmp_path / "fresh_log"))
        with pytest.raises(ChangeLogError, match=r"public\.\w+: its target holds changes up to LSN .* past the change "
                                                 r"log .* \(up to nothing\)"):
            replay_changelog(spark, fresh_log, apply_options(fresh_log))

        # Retention: trimmed through an LSN, the log refuses a rebuild that needs what it removed.
        config_file = tmp_path / "logged.json"
        config_file.write_text(json.dumps(config.model_dump(mode="json", exclude_defaults=True)))
        assert _trim("--config", str(config_file), "--older-than-days", "1") == 0
        assert "nothing removed" in capsys.readouterr().out
        held_through_middle = rows.where(rows["commit_lsn"] <= middle).count()
        assert _trim("--config", str(config_file), "--through-lsn", format_lsn(middle)) == 0
        removed = int(re.search(r"trim-changelog: ([0-9,]+) rows", capsys.readouterr().out)[1].replace(",", ""))
        assert removed == held_through_middle > 0
        assert changelog.trimmed_through == middle and changelog.read().where(f"commit_lsn <= {middle}").count() == 0
        with pytest.raises(ChangeLogError, match=rf"public\.\w+: the change log .* was trimmed through LSN "
                                                 rf"{format_lsn(middle)} .* holds changes only up to nothing"):
            replay_changelog(spark, config, replace(apply_options(config), warehouse=str(tmp_path / "after_trim")))
        # A target that holds the log past the trim is still brought up from it (here: nothing to do).
        held = replay_changelog(spark, config, options, table="public.tags", max_changes=100_000)
        assert held and all(t.skipped for batch in held for t in batch.tables)


def _load_for(conninfo: str, seconds: float, **options: object) -> None:
    load = Load(conninfo, **options).start()  # type: ignore[arg-type]
    time.sleep(seconds)
    load.finish()


def test_copied_tables_rebuild_from_the_change_log(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A copy's rows go into the log too: by Spark's tasks (tables of more than one page range) and by
    the driver (the rest), each copy after a Truncate row. A rebuild from the log alone equals
    PostgreSQL after a copy, changes, and a resync; a rebuild as of an LSN before a copy is refused."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "copied", "source": {"dsn": conninfo, "slot": "copied", "publication": "load"},
                           "target": {"warehouse": warehouse}, "batching": {"max_changes": 2000},
                           "snapshot": {"range_pages": 8, "ranges_per_commit": 4},
                           "changelog": {"enabled": True}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        _load_for(conninfo, 3, sessions=2, rate_per_session=40, big_every=60)  # rows to copy
        before_copy = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
        copied = {s.table: s for s in drain(config, spark).snapshots}
        assert {s.method for s in copied.values()} == {"ranges", "key order"}, copied
        changelog = ChangeLog(spark, config)
        copies = changelog.copies()
        assert all(c.logged for c in copies.values()) and {c.table for c in copies.values()} == set(TABLES)
        journal_oid = next(oid for oid, c in copies.items() if c.table == "public.journal")
        rows = changelog.read()
        by_copy = {r["table"]: (r["I"], r["T"]) for r in rows.where("xid = 0").groupBy("table").agg(
            *(F.count_if(F.col("op") == op).alias(op) for op in "IT")).collect()}
        assert by_copy == {name.split(".")[1]: (copied[name].rows, 1) for name in TABLES}

        _load_for(conninfo, 3, sessions=2, rate_per_session=20, big_every=30, seed=2)
        drain(config, spark)
        resync(config, spark, published_oids(config, ["public.accounts"]))  # a second copy, after a Truncate row
        _load_for(conninfo, 2, sessions=1, rate_per_session=20, big_every=0, seed=3)
        drain(config, spark)
        assert_delta_equals_postgres(spark, conn, warehouse)

        # Windows of fewer bytes of messages than the first copy's: it is read in pieces into a spill
        # file, as a large streamed transaction is.
        first_copy = rows.where(f"xid = 0 AND commit_lsn = {copies[journal_oid].version}") \
            .agg(F.sum(F.length("_cdc_change"))).collect()[0][0]
        small_windows = config.model_copy(update={"batching": config.batching.model_copy(
            update={"spill_bytes": first_copy - 1})})
        rebuilt = str(tmp_path / "rebuilt")
        with caplog.at_level(logging.INFO, logger="cdc_apply.changelog.applier"):
            replay_changelog(spark, small_windows, replace(apply_options(config), warehouse=rebuilt), max_changes=3000)
        # As few pieces as spill_bytes of messages and a window (3000 rows) allow, though the rows that
        # Spark's tasks copied have seqs with gaps (a page range's unused slots).
        copy_rows = rows.where(f"xid = 0 AND commit_lsn = {copies[journal_oid].version}").count()
        pieces = re.search(rf"the transaction committed at {format_lsn(copies[journal_oid].version)} \(\d+ changes\) "
                           r"read in (\d+) piece\(s\), spilled to disk", caplog.text)
        assert pieces and int(pieces[1]) == max(2, -(-copy_rows // 3000)), (copy_rows, caplog.text[-2000:])
        assert_delta_equals_postgres(spark, conn, rebuilt)
        for name in TABLES:  # the same rows as the live targets, metadata columns too where a key tells rows apart
            live, again = (Target(spark, f"{w}/{name.replace('.', '/')}", False).read() for w in (warehouse, rebuilt))
            if name in ("public.tags", "public.journal"):  # keyless: which of equal rows bears which LSN varies
                live, again = live.select(*TABLES[name]), again.select(*TABLES[name])
            assert live.exceptAll(again).count() == 0 and again.exceptAll(live).count() == 0, name
        # delta-rs reads the copies' rows as Spark does.
        logged = pa.RecordBatchReader.from_stream(DeltaTable(changelog.target.location).scan(
            columns=["xid", "op"])).read_all()
        assert pc.sum(pc.equal(logged["xid"], 0)).as_py() == changelog.read().where("xid = 0").count() > 0

        with pytest.raises(ChangeLogError, match=r"public\.\w+ \(relation \d+\): its rows came from an initial copy "
                                                 rf"at LSN .*, after LSN {before_copy}"):
            replay_changelog(spark, config, replace(apply_options(config), warehouse=str(tmp_path / "asof")),
                             until_lsn=parse_lsn(before_copy))
        assert not (tmp_path / "asof").exists()  # refused before it wrote anything
        # A copy recorded as not in the log (an earlier cdc_apply's, or one that resumed) is refused.
        oid, tags = next((oid, c) for oid, c in changelog.copies().items() if c.table == "public.tags")
        changelog.record_copy(oid, tags.table, tags.lsn, tags.rows, logged=False)
        with pytest.raises(ChangeLogError, match=r"public\.tags .*a copy's rows are not in the change log"):
            replay_changelog(spark, config, replace(apply_options(config), warehouse=str(tmp_path / "unlogged")))
        assert not (tmp_path / "unlogged").exists()


def test_replay_refuses_a_mix_of_captures_and_the_change_log() -> None:
    both = _cli("replay", "some.jsonl", "--changelog", "--config", "x.yaml")
    assert both.returncode == 2 and "not both" in both.stderr and "Traceback" not in both.stderr


def test_confirm_after_changelog_confirms_at_the_log_and_the_targets_follow(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``confirm_after: changelog``: ``run --once`` and ``run --follow`` under a load end with every
    target equal to PostgreSQL, brought up to date from the log (in windows across the log's
    batches), with the applied position recorded at the log's version."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = _config(conninfo, warehouse, pipeline="confirming", confirm_after="changelog")
    config = config.model_copy(update={"batching": config.batching.model_copy(update={"max_changes": 2000,
                                                                                      "max_seconds": 0.5})})
    position = AppliedPosition(PipelineState.at(warehouse, "confirming"))
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        drain(config, spark)  # the slot and the (empty) copies
        load = Load(conninfo, sessions=2, rate_per_session=20, big_every=40).start()
        try:
            time.sleep(1)
            once = drain(config, spark)
            assert once.changelog_rows > 0 and once.changelog_lag_seconds
            with BackgroundReplicator(config, spark) as follower:
                time.sleep(4)
                load.finish()
                follower.wait_caught_up(timeout=600)
                summary = follower.replicator.summary
                log_version = follower.replicator.changelog.version
                assert summary.metrics is not None and summary.metrics.targets_lsn._value.get() == log_version
        finally:
            load.finish()
        assert_delta_equals_postgres(spark, conn, warehouse)
        assert position.read() == log_version == ChangeLog(spark, config).version
        reported = pipeline_status(config)["changelog"]
        assert reported["lsn"] == reported["targets_applied_lsn"] == format_lsn(log_version)
        assert reported["targets_behind_bytes"] == 0 and reported["confirm_after"] == "changelog"
        assert summary.changelog_rows > 0 and summary.batches
        # Each logged transaction reached the targets in exactly one window: the recorded position
        # neither re-reads nor skips a part of the log.
        logged = ChangeLog(spark, config).read().where("xid != 0").select("commit_lsn").distinct().count()  # not copies
        assert sum(b.transactions for b in once.batches + summary.batches) == logged


def test_follow_changelog_keeps_the_targets_current_as_a_separate_streaming_job(db18, spark, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``changelog.targets: separate``: the run only appends to the log, and the targets wait; the
    follow-changelog query (``readStream.format("delta")`` on the log), in this process under a load
    and then as ``cdc-apply follow-changelog --once`` (its ``main`` in this process), brings every target equal to PostgreSQL,
    each logged transaction applied once. A run that applies the targets itself is refused."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = _config(conninfo, warehouse, pipeline="separate", confirm_after="changelog", targets="separate")
    config = config.model_copy(update={"stream": config.stream.model_copy(update={"interval_seconds": 0.5})})
    position = AppliedPosition(PipelineState.at(warehouse, "separate"))
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        drain(config, spark)  # the slot and the (empty) copies
        load = Load(conninfo, sessions=2, rate_per_session=10, big_every=40).start()
        try:
            time.sleep(2)
            assert drain(config, spark).changelog_rows > 0
            assert Target(spark, f"{warehouse}/public/ledger", False).read().count() == 0  # left to the follower
            query = start_changelog_stream(config, spark)
            try:
                time.sleep(2)
                drain(config, spark)
                load.finish()
                drain(config, spark)
                version = ChangeLog(spark, config).version
                deadline = time.monotonic() + 600
                while position.read() != version:
                    assert query.isActive, query.exception()
                    assert time.monotonic() < deadline, f"the targets hold the log up to {position.read()}, not {version}"
                    time.sleep(0.5)
            finally:
                query.stop()
        finally:
            load.finish()
        assert_delta_equals_postgres(spark, conn, warehouse)
        logged = ChangeLog(spark, config).read().where("xid != 0").select("commit_lsn").distinct().count()  # not copies
        assert sum(b.transactions for b in query.summary.batches) == logged  # each once, none skipped

        conn.execute("UPDATE ledger SET amount = amount + 1 WHERE seq % 2 = 0")
        conn.execute("DELETE FROM tags WHERE weight % 3 = 0")
        drain(config, spark)
        config_file = tmp_path / "separate.json"
        config_file.write_text(json.dumps(config.model_dump(mode="json", exclude_defaults=True)))
        code, out, err = _cli_here(capsys, "follow-changelog", "--config", str(config_file), "--once")
        assert code == 0, err[-3000:]
        assert re.search(r"follow-changelog: 1 window\(s\), [1-9][\d,]* changes applied", out), out
        assert_delta_equals_postgres(spark, conn, warehouse)

        in_process = _config(conninfo, warehouse, pipeline="separate", confirm_after="changelog")
        with pytest.raises(ConfigError, match="changelog.targets: cdc-apply follow-changelog"):
            start_changelog_stream(in_process, spark)


def test_the_streaming_job_keeps_the_change_log_in_either_confirm_mode(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``cdc-apply stream`` (``available_now``) with the change log, two pipelines over the same load:
    ``confirm_after: targets`` appends each micro-batch to the log and then applies it;
    ``confirm_after: changelog`` only appends, and the job's follower thread brings the targets up
    from the log before the run ends. Both logs hold the same changes, once each, and every target of
    both equals PostgreSQL."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    configs = {}
    for confirm_after in ("targets", "changelog"):
        config = _config(conninfo, str(tmp_path / confirm_after), pipeline=f"streamed_{confirm_after}",
                         confirm_after=confirm_after)
        configs[confirm_after] = config.model_copy(update={"stream": config.stream.model_copy(
            update={"trigger": "available_now"})})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        for config in configs.values():
            prepare_source(config)  # the slot, before the load
        load = Load(conninfo, sessions=2, rate_per_session=20, big_every=40).start()
        time.sleep(3)
        load.finish()
        identities = {}
        for confirm_after, config in configs.items():
            progress = run_stream(config, spark, StopFlag())
            assert sum(p["numInputRows"] for p in progress) > 300  # more than one micro-batch (max_changes)
            assert_delta_equals_postgres(spark, conn, config.target.warehouse)
            rows = ChangeLog(spark, config).read().select("commit_lsn", "xid", "seq", "relation_oid").collect()
            identities[confirm_after] = {tuple(row) for row in rows}
            assert len(identities[confirm_after]) == len(rows) > 0, "a change is in the log twice"
        assert identities["targets"] == identities["changelog"]
        followed = configs["changelog"]
        applied = AppliedPosition(PipelineState.at(followed.target.warehouse, followed.pipeline)).read()
        assert applied == ChangeLog(spark, followed).version
        targets = configs["targets"]
        assert AppliedPosition(PipelineState.at(targets.target.warehouse, targets.pipeline)).read() is None


def test_the_follower_yields_to_a_backlog_of_full_or_late_batches_until_the_stream_is_quiet() -> None:
    now = time.time()

    def batch(changes: int, committed_seconds_ago: float) -> list[Transaction]:
        commit_us = int((now - committed_seconds_ago) * 1e6) - PG_EPOCH_OFFSET_US
        return [Transaction(1, 100, 110, commit_us, [None] * changes)]  # type: ignore[list-item]

    assert not shows_a_backlog(batch(10, 1.0), 100, now)  # the steady state
    assert shows_a_backlog(batch(100, 1.0), 100, now)  # full
    assert shows_a_backlog(batch(10, BACKLOG_LAG_S + 1), 100, now)  # late: cut by time, behind
    assert not shows_a_backlog([], 100, now)

    assert not still_yielding(None, 0.0, 10.0)  # no backlog seen
    assert still_yielding(5.0, 9.0, 10.0)
    assert not still_yielding(5.0, 10.0 - BACKLOG_QUIET_S, 10.0)  # no batch for a while: caught up
    assert not still_yielding(10.0 - BACKLOG_YIELD_S, 10.0, 10.0)  # the targets never starve


def test_windows_of_the_log_end_at_max_changes_or_max_bytes_and_keep_a_spilling_transaction_alone() -> None:
    def cut(per_transaction: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        return [(w.first_lsn, w.last_lsn, w.rows) for w in transaction_windows(per_transaction, 100, 1000)]

    assert cut([(1, 10, 0), (2, 10, 0), (3, 500, 0), (4, 10, 0)]) == [(1, 3, 520), (4, 4, 10)]
    assert cut([(1, 60, 0), (2, 60, 0), (3, 10, 0)]) == [(1, 2, 120), (3, 3, 10)]
    assert cut([(1, 10, 600), (2, 10, 600), (3, 10, 10)]) == [(1, 2, 20), (3, 3, 10)]  # 1,200 bytes
    assert cut([(1, 10, 10), (2, 5, 5000), (3, 10, 10)]) == [(1, 1, 10), (2, 2, 5), (3, 3, 10)]  # few rows, many bytes
    assert cut([(5, 100, 0)]) == [(5, 5, 100)] and cut([]) == []


def test_a_spilled_transaction_goes_to_the_change_log_in_pieces(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A transaction past ``batching.spill_bytes`` (inserts, updates and deletes) is appended to the log
    a piece at a time, in one commit, each change once; a rebuild from the log, which reads it back
    in pieces too (it is past spill_bytes) into a spill file, equals PostgreSQL."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "pieces", "source": {"dsn": conninfo, "slot": "pieces", "publication": "load"},
                           "target": {"warehouse": warehouse}, "batching": {"spill_bytes": 64 * 1024},
                           "changelog": {"enabled": True}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        drain(config, spark)
        with conn.transaction():
            conn.execute("INSERT INTO accounts SELECT g, 'owner ' || g, g, NULL, now() FROM generate_series(1, 6000) g")
            conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id % 3 = 0")
            conn.execute("DELETE FROM accounts WHERE id % 7 = 0")
        summary = drain(config, spark)
        assert summary.changelog_pieces > 1
        assert summary.changelog_rows == 6000 + 2000 + 6000 // 7
        rows = ChangeLog(spark, config).read()
        assert rows.groupBy("commit_lsn", "xid", "seq", "relation_oid").count().where("count > 1").count() == 0
        history = spark.sql(f"DESCRIBE HISTORY delta.`{warehouse}/_cdc_apply/changelog`").where(
            "operation = 'WRITE' AND userMetadata NOT LIKE '%changelog copy%'")  # not the empty copies' Truncate rows
        assert history.count() == 1  # the pieces in one commit
        assert_delta_equals_postgres(spark, conn, warehouse)
        rebuilt = str(tmp_path / "rebuilt")
        caplog.set_level(logging.INFO, logger="cdc_apply")
        results = replay_changelog(spark, config, replace(apply_options(config), warehouse=rebuilt), max_changes=1000)
        # The empty copies' Truncate rows, then the transaction: its target exists by then, so Spark's
        # executors collapse it (a copy's rows read in pieces: test_copied_tables_rebuild_from_the_change_log).
        assert [r.transactions for r in results] == [1, 1]
        assert re.search(r"public\.accounts: .* \(merge, collapsed by Spark\)", caplog.text), caplog.text[-3000:]
        columns = TABLES["public.accounts"]
        assert delta_rows(spark, f"{rebuilt}/public/accounts", columns, source_types(conn, "public.accounts")) == \
            postgres_rows(conn, "public.accounts", columns)


def test_a_large_update_transaction_is_collapsed_by_spark_from_the_change_log(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Under ``confirm_after: changelog``, a transaction past ``spill_bytes`` that updates and deletes
    rows of existing targets is collapsed per key by Spark's executors (``changelog/log_collapse.py``),
    TOAST carried forward and keys changed; one that moves a row with an unchanged TOAST value to
    another key is refused there and applied on the driver. Under ``confirm_after: targets`` the
    stream's spilled transaction is collapsed by Spark from the log too. Each ends equal to PostgreSQL."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "executors", "source": {"dsn": conninfo, "slot": "executors", "publication": "load"},
                           "target": {"warehouse": warehouse}, "batching": {"spill_bytes": 64 * 1024},
                           "changelog": {"enabled": True, "confirm_after": "changelog"}})
    big_note = "(SELECT string_agg(md5(random()::text || i), '') FROM generate_series(1, 80) i)"  # TOASTed
    caplog.set_level(logging.INFO, logger="cdc_apply")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        conn.execute(f"INSERT INTO accounts SELECT g, 'owner ' || g, g, CASE WHEN g % 5 = 0 THEN {big_note} END, "
                     "now() FROM generate_series(1, 3000) g")
        drain(config, spark)  # the copy: the targets exist before the transactions below
        with conn.transaction():
            conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id % 3 = 0")  # notes unchanged TOAST
            conn.execute("DELETE FROM accounts WHERE id % 7 = 0")
            conn.execute("UPDATE accounts SET id = id + 100000 WHERE id % 11 = 0 AND note IS NULL")  # moved rows
            conn.execute("INSERT INTO accounts SELECT g, 'new ' || g, g, NULL, now() FROM generate_series(5001, 5400) g")
            conn.execute("UPDATE accounts SET owner = owner || ' again', balance = balance * 2 WHERE id % 2 = 0")
            conn.execute("DELETE FROM accounts WHERE id BETWEEN 5001 AND 5100")
            conn.execute("INSERT INTO ledger SELECT g, 1, g, 1 FROM generate_series(1, 50) g")
        drain(config, spark)
        assert re.search(r"public\.accounts: .* \(merge, collapsed by Spark\)", caplog.text), caplog.text[-3000:]
        assert "collapsing on the executors failed" not in caplog.text
        assert_delta_equals_postgres(spark, conn, warehouse)
        caplog.clear()
        with conn.transaction():  # rows with an unchanged TOAST value moved to new keys: the driver's collapse
            conn.execute("UPDATE accounts SET id = id + 200000, balance = 0 WHERE id % 5 = 0 AND note IS NOT NULL")
            conn.execute("UPDATE accounts SET balance = balance - 1 WHERE id < 3000")
        drain(config, spark)
        assert "public.accounts at" in caplog.text and "collapsing on the executors failed" in caplog.text
        assert "refused a group of public.accounts" in caplog.text, caplog.text[-3000:]
        assert_delta_equals_postgres(spark, conn, warehouse)
        caplog.clear()  # confirm_after: targets: the stream's spilled transaction, collapsed by Spark from the log
        targets_first = config.model_copy(update={"changelog": config.changelog.model_copy(update={"confirm_after": "targets"})})
        with conn.transaction():
            conn.execute("UPDATE accounts SET balance = balance + 5 WHERE id % 2 = 1")
            conn.execute("DELETE FROM accounts WHERE id % 9 = 0")
        drain(targets_first, spark)
        assert re.search(r"public\.accounts: .* \(merge, collapsed by Spark\)", caplog.text), caplog.text[-3000:]
        assert "bringing the targets up to date from the change log" not in caplog.text  # the stream applied it
        assert_delta_equals_postgres(spark, conn, warehouse)
