"""The ``pgoutput`` Spark data source and the ``foreach_batch`` apply, on a real PostgreSQL and Delta.

- Streamed through ``readStream.format("pgoutput")`` + ``foreachBatch``, a concurrent workload
  ends with Delta equal to PostgreSQL; a restart from the checkpoint applies nothing twice.
- Batch reads of capture files equal ``cdc-apply decode --changes``; a slot read does not consume.
- Bad options fail naming the option.
"""

from __future__ import annotations

import datetime
import decimal
import json
import time

import psycopg
import pytest

from cdc_apply.changerows.segments import ChangeRowBuilder
from cdc_apply.spark.foreach import APPLY_COLUMNS, ROW_COLUMNS, foreach_batch, micro_batch_changes
from cdc_apply.bench.load import Load, create_schema
from cdc_apply.config import parse_config
from cdc_apply.lsn import parse_lsn
from cdc_apply.pgtypes import lookup
from cdc_apply.sources.capture import write_jsonl, write_parquet
from cdc_apply.sources.slot import PgOutputOptions, confirmed_flush, create_slot, read_changes
from cdc_apply.stream_job import checkpoint_location, offset_lsn, start_stream
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from tests.test_decode_cli import _cli
from tests.test_live import assert_delta_equals_postgres


def _stream_config(conninfo: str, warehouse: str, **stream: object):  # type: ignore[no-untyped-def]
    return parse_config({"pipeline": "ds", "source": {"dsn": conninfo, "slot": "ds", "publication": "load"},
                         "target": {"warehouse": warehouse},
                         "stream": {"interval_seconds": 0.5, "max_changes_per_trigger": 4000, **stream}})


def _journal_count(spark, warehouse: str) -> int:  # type: ignore[no-untyped-def]
    return spark.read.format("delta").load(f"{warehouse}/public/journal").count()


@pytest.mark.timeout(1200)
def test_a_streaming_query_keeps_delta_equal_to_postgres(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = _stream_config(conninfo, warehouse)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        create_schema(conn, "load")
        create_slot(conn, "ds")
        load = Load(conninfo, sessions=2, rate_per_session=30, big_every=80).start()
        query = start_stream(config, spark)
        try:
            time.sleep(12)
            load.finish()
            query.processAllAvailable()
            batches = [p for p in query.recentProgress if p["numInputRows"]]
        finally:
            query.stop()
        assert load.committed > 50 and len(batches) >= 2
        # Each batch reports its LSN range; ranges follow each other without gaps or overlap.
        ranges = [(offset_lsn(p["sources"][0]["startOffset"]), offset_lsn(p["sources"][0]["endOffset"])) for p in batches]
        assert all(end != "-" and parse_lsn(end) > 0 for _, end in ranges)
        assert all(later[0] == earlier[1] for earlier, later in zip(ranges, ranges[1:]) if later[0] != "-")
        assert_delta_equals_postgres(spark, conn, warehouse)
        journal = _journal_count(spark, warehouse)
        # The slot never runs ahead of Delta, and a restart from the checkpoint re-applies nothing.
        conn.execute("INSERT INTO journal (session, n, what) VALUES (99, 1, 'after restart')")
        query = start_stream(config, spark)
        try:
            query.processAllAvailable()
        finally:
            query.stop()
        assert _journal_count(spark, warehouse) == journal + 1
        assert_delta_equals_postgres(spark, conn, warehouse)
        assert confirmed_flush(conn, "ds") > 0
        # The slot gone (a failover without a synced copy): the checkpoint's query stops, never
        # creating a new slot that would start now.
        conn.execute("SELECT pg_drop_replication_slot('ds')")
        query = start_stream(config, spark)
        try:
            with pytest.raises(Exception, match=r"replication slot 'ds' does not exist on .* but this query's "
                                                 r"checkpoint is at LSN"):
                query.processAllAvailable()
        finally:
            query.stop()
        assert confirmed_flush(conn, "ds") == 0


def test_a_batch_replayed_with_its_id_is_skipped(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """foreach_batch's txnAppId/txnVersion (the batch's last commit LSN): the same batch applied again,
    by Spark with its id or by a new checkpoint's query with new ids, changes nothing, also for a
    table without a key, which is appended."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int); CREATE TABLE log (n int)")
        conn.execute("ALTER TABLE log REPLICA IDENTITY NOTHING; CREATE PUBLICATION load FOR TABLE t, log")
        create_slot(conn, "ds")
        conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 20) g")
        conn.execute("UPDATE t SET n = n + 1")
        conn.execute("INSERT INTO log SELECT 7 FROM generate_series(1, 5)")  # identical rows, kept apart
    frame = spark.read.format("pgoutput").option("dsn", conninfo).option("slot", "ds").option("publication", "load").load()
    apply = foreach_batch(_stream_config(conninfo, warehouse))
    spark.sparkContext.setLocalProperty("sql.streaming.queryId", "query-1")
    try:
        apply(frame, 0)
        apply(frame, 0)  # Spark re-running batch 0 after a failure
        spark.sparkContext.setLocalProperty("sql.streaming.queryId", "query-2")
        fresh = foreach_batch(_stream_config(conninfo, warehouse))
        fresh(frame, 0)  # a new checkpoint over a slot that holds the applied changes still
    finally:
        spark.sparkContext.setLocalProperty("sql.streaming.queryId", None)
    first, again = apply.summary.batches  # type: ignore[attr-defined]
    (anew,) = fresh.summary.batches  # type: ignore[attr-defined]
    assert [t.skipped for t in first.tables] == [False, False]
    assert [t.skipped for t in again.tables] == [True, True] == [t.skipped for t in anew.tables]
    rows = spark.read.format("delta").load(f"{warehouse}/public/t").orderBy("id").collect()
    assert [(r.id, r.n) for r in rows] == [(g, g + 1) for g in range(1, 21)]
    assert [r.n for r in spark.read.format("delta").load(f"{warehouse}/public/log").collect()] == [7] * 5
    history = spark.sql(f"DESCRIBE HISTORY delta.`{warehouse}/public/t`").collect()
    assert [h.operation for h in history if h.operation in ("MERGE", "WRITE")] == ["WRITE"]  # new rows: appended
    assert '"stream_batch": {"batch": 0, "query": "query-1"}' in next(h.userMetadata for h in history
                                                                   if h.operation == "WRITE")
    with psycopg.connect(conninfo, autocommit=True) as conn:  # both targets, read by Spark and delta-rs
        for table, columns in (("t", ["id", "n"]), ("log", ["n"])):
            assert delta_rows(spark, f"{warehouse}/public/{table}", columns, source_types(conn, f"public.{table}")) \
                == postgres_rows(conn, f"public.{table}", columns), table


def test_batch_reads_equal_decode_and_do_not_consume_the_slot(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, d date, amount numeric(8,2), big text)")
        conn.execute("ALTER TABLE t REPLICA IDENTITY FULL")
        conn.execute("CREATE TABLE u (k bigint PRIMARY KEY, at timestamptz)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t, u")
        create_slot(conn, "cap")
        conn.execute("INSERT INTO t VALUES (1, 'a', '2024-01-02', 1.5, repeat('x', 10000)), (2, NULL, NULL, -3, NULL)")
        conn.execute("INSERT INTO u VALUES (7, '2024-05-06 07:08:09.123456+02')")
        conn.execute("UPDATE t SET v = 'b' WHERE id = 1")
        conn.execute("UPDATE t SET id = 3 WHERE id = 2")
        conn.execute("DELETE FROM u")
        conn.execute("TRUNCATE t")
        raws = list(read_changes(conn, "cap", PgOutputOptions(("p",))))
        before = confirmed_flush(conn, "cap")
        from_slot = (spark.read.format("pgoutput").option("dsn", conninfo).option("slot", "cap")
                     .option("publication", "p").load().collect())
        assert confirmed_flush(conn, "cap") == before
    jsonl, parquet = tmp_path / "c.jsonl", tmp_path / "c.parquet"
    write_jsonl(jsonl, raws)
    write_parquet(parquet, raws)
    decoded = [json.loads(line) for line in _cli("decode", "--changes", str(jsonl)).stdout.splitlines()]
    assert len(decoded) == 7
    for path in (jsonl, parquet):
        rows = spark.read.format("pgoutput").load(str(path)).collect()
        _assert_rows_equal_decode(rows, decoded)
    _assert_rows_equal_decode(from_slot, decoded)


def _assert_rows_equal_decode(rows, decoded) -> None:  # type: ignore[no-untyped-def]
    ordered = sorted(rows, key=lambda r: (r.commit_lsn, r.seq))
    decoded = sorted(decoded, key=lambda d: (parse_lsn(d["commit_lsn"]), d["seq"]))
    assert len(ordered) == len(decoded)
    types = {"id": 23, "v": 25, "d": 1082, "amount": 1700, "big": 25, "k": 20, "at": 1184}
    typmods = {"amount": (8 << 16 | 2) + 4}
    for row, want in zip(ordered, decoded, strict=True):
        assert (row.op, row.schema, row.table, row.seq, row.xid) == (want["op"], want["schema"], want["table"],
                                                                      want["seq"], want["xid"])
        assert sorted(row.unchanged) == sorted(want["unchanged"])
        for image in ("key", "old", "new"):
            got, expected = getattr(row, image), want[image]
            if expected is None:
                assert got is None, (image, row)
                continue
            rendered = {name: None if text is None else _render(types[name], text, typmods.get(name, -1))
                        for name, text in got.items()}
            assert rendered == {k: v for k, v in expected.items() if k in rendered}, (image, row)
            assert set(expected) - set(rendered) <= set(row.unchanged)


def _render(oid: int, text: str, typmod: int) -> object:
    pg_type = lookup(oid)
    assert pg_type is not None
    return pg_type.to_json(pg_type.from_text(text, typmod))


def test_typed_reads_of_one_table(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """option("table"): that table's rows only, images typed by its Relation; earlier rows of an
    added column read null, a dropped column fails the read naming it; text, binary and files agree."""
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, d date, amount numeric(8,2), tags int[], "
                     "at timestamptz, big text)")
        conn.execute("CREATE TABLE other (k int PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t, other")
        create_slot(conn, "typed")
        create_slot(conn, "typed_stream")
        big = "".join(f"{n:08x}" for n in range(2000))  # stored out of line: compresses poorly
        conn.execute("INSERT INTO t VALUES (1, 'a', '2024-01-02', 1.5, '{1,2}', '2024-05-06 07:08:09.123456+02', "
                     "%s), (2, NULL, NULL, -3, NULL, NULL, NULL)", (big,))
        conn.execute("INSERT INTO other VALUES (5)")
        conn.execute("UPDATE t SET v = 'b' WHERE id = 1")  # big is unchanged TOAST
        conn.execute("ALTER TABLE t ADD COLUMN extra bigint")
        conn.execute("INSERT INTO t (id, v, extra) VALUES (3, 'c', 9)")
        conn.execute("DELETE FROM t WHERE id = 2")
        raws = list(read_changes(conn, "typed", PgOutputOptions(("p",))))
        before = confirmed_flush(conn, "typed")

        def read(reader=spark.read, **options: str):  # type: ignore[no-untyped-def]
            reader = reader.format("pgoutput").option("table", "t")
            for key, value in {"dsn": conninfo, "slot": "typed", "publication": "p", **options}.items():
                reader = reader.option(key, value)
            return reader.load()

        frame = read()
        assert frame.schema["key"].dataType.simpleString() == "struct<id:int>"
        assert frame.schema["new"].dataType.simpleString() == (
            "struct<id:int,v:string,d:date,amount:decimal(8,2),tags:array<int>,at:timestamp,big:string,extra:bigint>")
        rows = sorted(frame.collect(), key=lambda r: (r.commit_lsn, r.seq))
        assert [(r.table, r.op, r.key.id) for r in rows] == [("t", "I", 1), ("t", "I", 2), ("t", "U", 1),
                                                               ("t", "I", 3), ("t", "D", 2)]
        first = rows[0].new
        assert (first.v, first.d, first.amount, first.tags, first.big, first.extra) == (
            "a", datetime.date(2024, 1, 2), decimal.Decimal("1.50"), [1, 2], big, None)
        assert first.at == datetime.datetime(2024, 5, 6, 5, 8, 9, 123456)  # the session's time zone is UTC
        assert rows[2].new.v == "b" and rows[2].new.big is None and rows[2].unchanged == ["big"]
        assert rows[3].new.extra == 9 and rows[4].new is None and rows[4].key.id == 2
        assert confirmed_flush(conn, "typed") == before
        # Binary values and the same messages from a capture file give the same rows.
        capture = tmp_path / "t.jsonl"
        write_jsonl(capture, raws)
        from_file = spark.read.format("pgoutput").option("table", "public.t").load(str(capture)).collect()
        assert sorted(from_file, key=lambda r: (r.commit_lsn, r.seq)) == rows
        binary = sorted(read(binary="true").collect(), key=lambda r: (r.commit_lsn, r.seq))
        assert [r[:-1] for r in binary] == [r[:-1] for r in rows]  # all but _cdc_change, the message itself
        # A streaming read gives the same rows.
        query = (read(spark.readStream, slot="typed_stream").writeStream.format("memory").queryName("typed_t")
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        assert sorted(spark.table("typed_t").collect(), key=lambda r: (r.commit_lsn, r.seq)) == rows
        # foreach_batch takes the typed rows as they are where the read schema fits (after ADD COLUMN),
        # and converts the messages before it.
        transactions, parsed = micro_batch_changes(frame.select(*APPLY_COLUMNS, *ROW_COLUMNS).toArrow())
        segments = ChangeRowBuilder().build(transactions, parsed)
        assert [parsed.table(segment) is not None for segment in segments] == [False, True]
        # foreach_batch applies a typed frame as it does a text one: Delta equals PostgreSQL.
        warehouse = str(tmp_path / "wh")
        apply = foreach_batch(_stream_config(conninfo, warehouse))
        spark.sparkContext.setLocalProperty("sql.streaming.queryId", "typed")
        try:
            apply(frame, 0)
        finally:
            spark.sparkContext.setLocalProperty("sql.streaming.queryId", None)
        columns = ["id", "v", "d", "amount", "at", "big", "extra"]  # (the oracle renders no arrays)
        assert (delta_rows(spark, f"{warehouse}/public/t", columns, source_types(conn, "public.t"))
                == postgres_rows(conn, "public.t", columns))
        # A column the read schema no longer has is an error naming it, never dropped silently.
        conn.execute("ALTER TABLE t DROP COLUMN v")
        with pytest.raises(Exception, match="public.t changed at LSN .*column 'v' is not in the read schema"):
            read().collect()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("proto_version", "9", "proto_version"),
    ("streaming", "sometimes", "streaming"),
    ("binary", "true", "binary: needs the table option"),
    ("table", "public.", "table: must be 'schema.table'"),
    ("maxChangesPerTrigger", "0", "maxChangesPerTrigger"),
    ("slott", "x", "slott: unknown key"),
])
def test_bad_options_fail_naming_the_option(spark, option: str, value: str, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception, match=message):
        spark.read.format("pgoutput").option(option, value).option("path", "/nonexistent.jsonl").load().collect()


def test_the_stream_checkpoint_defaults_under_the_warehouse(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _stream_config("host=x", str(tmp_path / "wh"))
    assert checkpoint_location(config) == str(tmp_path / "wh" / "_cdc_apply" / "checkpoints" / "ds")
    assert parse_config({"stream": {"checkpoint_location": "/c"}}).stream.checkpoint_location == "/c"


@pytest.mark.timeout(900)
def test_run_once_then_stream_applies_nothing_twice(any_db, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """docs/streaming.md's procedure under a concurrent writer: ``run --once`` creates the slot and
    copies the tables at a later consistent point; the streaming query then starts at the slot and
    must not apply the transactions the copy already holds (an insert-only table would double them)."""
    import threading

    from cdc_apply.pipeline import drain

    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "handoff", "source": {"dsn": conninfo, "slot": "handoff",
                                                             "create_publication": True},
                           "target": {"warehouse": warehouse},
                           "stream": {"trigger": "available_now", "max_changes_per_trigger": 500}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE feed (n int, at timestamptz DEFAULT clock_timestamp())")
        conn.execute("ALTER TABLE feed REPLICA IDENTITY NOTHING")
        conn.execute("CREATE TABLE keyed (id int PRIMARY KEY, n int)")
        conn.execute("INSERT INTO feed (n) SELECT g FROM generate_series(1, 100) g")
        stop = threading.Event()

        def write() -> None:
            with psycopg.connect(conninfo, autocommit=True) as writer:
                n = 1000
                while not stop.is_set():
                    writer.execute("INSERT INTO feed (n) VALUES (%s)", (n,))
                    writer.execute("INSERT INTO keyed VALUES (%s, 1) ON CONFLICT (id) DO UPDATE SET n = keyed.n + 1",
                                   (n % 40,))
                    n += 1
                    time.sleep(0.02)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            time.sleep(1)
            first = drain(config, spark)  # run --once: slot, publication, copy
            assert {s.table for s in first.snapshots} == {"public.feed", "public.keyed"}
            time.sleep(1)
        finally:
            stop.set()
            writer.join()
        query = start_stream(config, spark)
        try:
            query.awaitTermination(600)
        finally:
            query.stop()
        for name, columns in {"public.feed": ["n", "at"], "public.keyed": ["id", "n"]}.items():
            truth = postgres_rows(conn, name, columns)
            got = delta_rows(spark, f"{warehouse}/{name.replace('.', '/')}", columns, source_types(conn, name))
            assert got == truth, name


def test_foreach_batch_on_capture_rows_needs_no_server(any_db, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An ADD COLUMN ... DEFAULT in a capture: offline, live_source=False skips the catalog lookup."""
    from cdc_apply.errors import CdcApplyError
    from cdc_apply.pgserver import free_port

    server, dbname = any_db
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION load FOR TABLE t")
        create_slot(conn, "offline")
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute("ALTER TABLE t ADD COLUMN c text DEFAULT 'dflt'")
        conn.execute("INSERT INTO t VALUES (2, 'b')")
        capture = tmp_path / "c.jsonl"
        write_jsonl(capture, read_changes(conn, "offline", PgOutputOptions(("load",))))
    frame = spark.read.format("pgoutput").load(str(capture))
    nowhere = f"host=127.0.0.1 port={free_port()} dbname=x user=x connect_timeout=2"
    spark.sparkContext.setLocalProperty("sql.streaming.queryId", "offline")
    try:
        with pytest.raises(CdcApplyError, match=r"backfill of column 'c' needs the source .*live_source=False"):
            foreach_batch(_stream_config(nowhere, str(tmp_path / "wh1")))(frame, 0)
        apply = foreach_batch(_stream_config(nowhere, str(tmp_path / "wh2")), live_source=False)
        apply(frame, 0)
        apply(frame.limit(0), 1)  # an empty micro-batch (the offset moved over other WAL) applies nothing
        empty = apply.summary.batches[-1]  # type: ignore[attr-defined]
        assert (empty.transactions, empty.tables) == (0, [])
    finally:
        spark.sparkContext.setLocalProperty("sql.streaming.queryId", None)
    rows = spark.read.format("delta").load(str(tmp_path / "wh2" / "public" / "t")).orderBy("id").collect()
    assert [(r.id, r.v, r.c) for r in rows] == [(1, "a", None), (2, "b", "dflt")]  # as replay: no backfill


def test_the_publication_option_names_one_or_several() -> None:
    from cdc_apply.spark.reader_options import reader_options

    assert reader_options({"publication": "a,b"}).source.publications == ("a,b",)  # a name may hold a comma
    assert reader_options({"publication": '["orders pub", "audit"]'}).source.publications == ("orders pub", "audit")
