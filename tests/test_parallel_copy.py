"""The initial copy run by Spark's tasks (``snapshot/pgcopy.py``), against PostgreSQL 15 and 18 under
concurrent writes: a table with every type of the type matrix, a keyless table with identical rows,
partitioned tables published through their root and through their leaves, a row-filtered and a
column-listed table. Each copy is split into 2-page ranges over 3 tasks; after the copy, the slot's
changes on top; then every target equals PostgreSQL, read by Spark and by delta-rs."""

from __future__ import annotations

import random
import threading
import time

import psycopg

from cdc_apply.apply.options import apply_options
from cdc_apply.apply.targets import Target
from cdc_apply.config import parse_config
from cdc_apply.pipeline import drain
from tests.delta_oracle import _arrow_carried, delta_rows, file_statistics, parquet_writers, source_types
from tests.reference_apply import postgres_rows
from tests.test_type_roundtrip import MATRIX

ROWS_PER_VARIANT = 40  # copies of each row of the matrix
# One column per type of the matrix; a two-dimensional array needs evolve (tests/test_faithful.py).
TYPES = {f"c{i}": name for i, name in enumerate(MATRIX)}
VARIANTS = [{column: MATRIX[kind][row] for column, kind in TYPES.items()
             if row < len(MATRIX[kind]) and MATRIX[kind][row] != "'{{1,2},{3,4}}'"}
            for row in range(max(len(v) for v in MATRIX.values()))]

SCHEMA = f"""
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE typed (id int PRIMARY KEY, {", ".join(f"{c} {t}" for c, t in TYPES.items())});
CREATE TABLE bag (a int, b text);
ALTER TABLE bag REPLICA IDENTITY FULL;
INSERT INTO bag SELECT g % 50, 'same' FROM generate_series(1, 3000) g;
CREATE TABLE root (id int, region text, v int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE root_eu PARTITION OF root FOR VALUES IN ('eu');
CREATE TABLE root_us PARTITION OF root FOR VALUES IN ('us');
INSERT INTO root SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, g FROM generate_series(1, 3000) g;
CREATE TABLE leaf (id int, region text, v int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE leaf_eu PARTITION OF leaf FOR VALUES IN ('eu');
CREATE TABLE leaf_us PARTITION OF leaf FOR VALUES IN ('us');
INSERT INTO leaf SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, g FROM generate_series(1, 3000) g;
CREATE TABLE filtered (id int PRIMARY KEY, region text, v int);
INSERT INTO filtered SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, g FROM generate_series(1, 3000) g;
CREATE TABLE listed (id int PRIMARY KEY, a text, secret text, c int);
INSERT INTO listed SELECT g, 'a' || g, 'hidden', g FROM generate_series(1, 3000) g;
CREATE PUBLICATION via_root FOR TABLE typed, bag, root, filtered WHERE (id % 3 = 0)
    WITH (publish_via_partition_root = true);
CREATE TABLE "odd/../na`me" ("k`ey, x" int PRIMARY KEY, "v.al ue:" text);
INSERT INTO "odd/../na`me" SELECT g, 'v' || g FROM generate_series(1, 3000) g;
CREATE PUBLICATION via_leaves FOR TABLE leaf, listed (id, a, c), "odd/../na`me";
"""

# The typed table against PostgreSQL's text: the columns whose text the oracle renders alike. Every
# column is compared with the same table copied by the driver (whose values tests/test_type_delta.py
# holds equal to PostgreSQL's) instead.
COMPARED = {  # table -> (columns, publication, the rows the publication sends)
    "public.typed": (["id", "c0", "c1", "c2", "c3", "c11", "c12", "c22", "c40"], "via_root", None),
    "public.bag": (["a", "b"], "via_root", None),
    "public.root": (["id", "region", "v"], "via_root", None),
    "public.filtered": (["id", "region", "v"], "via_root", "id % 3 = 0"),
    "public.leaf_eu": (["id", "region", "v"], "via_leaves", None),
    "public.leaf_us": (["id", "region", "v"], "via_leaves", None),
    "public.listed": (["id", "a", "c"], "via_leaves", None),
    "public.odd/../na`me": (["k`ey, x", "v.al ue:"], "via_leaves", None),  # hostile names
}


def _fill_typed(conn: psycopg.Connection) -> None:
    for row, values in enumerate(VARIANTS):
        conn.execute(f"INSERT INTO typed (id, {', '.join(values)}) "
                     f"VALUES ({row}, {', '.join(f'({v})::{TYPES[c]}' for c, v in values.items())})")
    conn.execute("INSERT INTO typed SELECT t.id + 100 * g, " + ", ".join(TYPES) +
                 f" FROM typed t, generate_series(1, {ROWS_PER_VARIANT}) g")


def _writes(conninfo: str, stop: threading.Event) -> int:
    """Updates, deletes, inserts and partition moves while the copy runs."""
    done = 0
    rng = random.Random(7)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while not stop.is_set():
            k = rng.randrange(1, 3000)
            conn.execute("UPDATE typed SET c0 = NOT c0, c11 = c11 || 'x' WHERE id %% 97 = %s", (k % 97,))
            conn.execute("DELETE FROM bag WHERE ctid IN (SELECT ctid FROM bag WHERE a = %s LIMIT 1)", (k % 50,))
            conn.execute("INSERT INTO bag VALUES (%s, 'same'), (%s, 'same')", (k % 50, k % 50))
            for table in ("root", "leaf"):
                conn.execute(f"UPDATE {table} SET region = CASE region WHEN 'eu' THEN 'us' ELSE 'eu' END, v = -v "
                             "WHERE id = %s", (k,))
                conn.execute(f"INSERT INTO {table} VALUES (%s, 'eu', 1) ON CONFLICT DO NOTHING", (3000 + k,))
            conn.execute("UPDATE filtered SET v = -v WHERE id = %s", (k,))
            conn.execute("UPDATE filtered SET id = id + 100001 WHERE id = %s", (k + 7,))  # in or out of the filter
            conn.execute("UPDATE listed SET c = -c, secret = 'changed' WHERE id = %s", (k,))
            conn.execute("DELETE FROM listed WHERE id = %s", (k + 1,))
            conn.execute('UPDATE "odd/../na`me" SET "v.al ue:" = %s WHERE "k`ey, x" = %s', (f"w{k}", k))
            done += 1
            time.sleep(0.01)
    return done


def test_a_parallel_copy_under_writes_equals_postgres(any_db, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = any_db
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    snapshot = {"method": "spark", "range_pages": 2, "ranges_per_commit": 4, "max_connections": 3, "parallelism": 3}
    configs = [parse_config({"pipeline": name, "source": {"dsn": conninfo, "slot": name, "publication": name},
                             "target": {"warehouse": warehouse}, "snapshot": snapshot})
               for name in ("via_root", "via_leaves")]
    by_driver = parse_config({"pipeline": "driver", "source": {"dsn": conninfo, "slot": "driver", "publication": "via_root"},
                              "target": {"warehouse": f"{warehouse}_driver"}, "snapshot": {"method": "driver"}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SCHEMA)
        _fill_typed(conn)
        stop = threading.Event()
        writes: list[object] = []

        def write() -> None:
            try:
                writes.append(_writes(conninfo, stop))
            except Exception as exc:  # noqa: BLE001 - reported by the assert below
                writes.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            copied = [drain(config, spark).snapshots for config in configs]
        finally:
            stop.set()
            writer.join()
        assert isinstance(writes[0], int) and writes[0] > 0, writes
        rows = {s.table: s.rows for run in copied for s in run}
        assert set(rows) == set(COMPARED) and rows["public.typed"] >= len(VARIANTS) * ROWS_PER_VARIANT
        for config in [*configs, by_driver]:
            drain(config, spark)
        locations = {config.source.publications[0]: apply_options(config) for config in configs}
        for table, (columns, publication, where) in COMPARED.items():
            truth = [r for r in postgres_rows(conn, table, columns)]
            if where:
                schema, _, name = table.partition(".")
                select = ", ".join(f'"{c}"::text' for c in columns)
                truth = sorted((tuple(r) for r in conn.execute(
                    f'SELECT {select} FROM "{schema}"."{name}" WHERE {where}').fetchall()), key=repr)
            path, _ = locations[publication].default_target(*table.split(".", 1))
            got = delta_rows(spark, path, columns, source_types(conn, table))
            assert got == truth, f"{table}: {len(got)} rows in Delta, {len(truth)} in PostgreSQL"
        _assert_same_rows(spark, f"{warehouse}/public/typed", f"{warehouse}_driver/public/typed")
        typed = Target(spark, f"{warehouse}/public/typed", False).history()
        copies = [h for h in typed if h.userMetadata and '"snapshot"' in h.userMetadata]
        assert len(copies) >= 2  # ranges_per_commit 4 of 2 pages: several commits
        # The tasks wrote the copy's Parquet files themselves (pyarrow), with column mapping's
        # physical names where the target has them (the hostile names).
        for table in ("public.typed", "public.odd/../na`me"):
            path, _ = locations[COMPARED[table][1]].default_target(*table.split(".", 1))
            assert "parquet-cpp-arrow" in parquet_writers(path), table
        # Their files carry exact min/max values of integer columns: filters that skip files by them
        # read what PostgreSQL holds.
        assert any("id" in stats.get("minValues", {}) for stats in file_statistics(f"{warehouse}/public/typed"))
        ids = [row[0] for row in conn.execute("SELECT id FROM typed").fetchall()]
        frame = spark.read.format("delta").load(f"{warehouse}/public/typed")
        for low, high in ((min(ids), sorted(ids)[len(ids) // 3]), (sorted(ids)[len(ids) // 2], max(ids)),
                          (max(ids) + 1, max(ids) + 10)):
            assert frame.where(f"id BETWEEN {low} AND {high}").count() == sum(low <= i <= high for i in ids)


def _assert_same_rows(spark, path: str, other: str) -> None:  # type: ignore[no-untyped-def]
    """Two Delta tables hold the same rows, by Spark (NaN equal to NaN) and by delta-rs (every column
    but timestamptz: delta-rs 1.6.6 reads 'infinity' and years BC wrongly, whoever wrote them)."""
    import pyarrow as pa
    from deltalake import DeltaTable

    columns = ["id", *TYPES]
    left, right = (spark.read.format("delta").load(p).select(columns) for p in (path, other))
    assert left.count() == right.count() > 0
    assert left.exceptAll(right).count() == 0 and right.exceptAll(left).count() == 0
    readable = [c for c in columns if TYPES.get(c) != "timestamptz"]
    tables = [pa.RecordBatchReader.from_stream(DeltaTable(p).scan(columns=readable)).read_all() for p in (path, other)]
    rows = [sorted(zip(*(_arrow_carried(t.column(c).combine_chunks()).to_pylist() for c in readable)), key=repr)
            for t in tables]
    assert repr(rows[0]) == repr(rows[1])


def test_a_value_spark_tasks_cannot_convert_is_copied_by_the_driver(db18, spark, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A two-dimensional array in an int[] column: its Arrow type holds depth one only, so Spark's task
    stops with the driver marker, and the driver copies the table again from the start, where
    ``schema_policy: evolve`` switches the column to PostgreSQL's text."""
    import logging

    server, dbname = db18
    conninfo = server.conninfo(dbname)
    warehouse = str(tmp_path / "wh")
    config = parse_config({"pipeline": "arrays", "source": {"dsn": conninfo, "slot": "arrays", "publication": "arrays"},
                           "target": {"warehouse": warehouse}, "defaults": {"schema_policy": "evolve"},
                           "snapshot": {"range_pages": 2}})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE grid (id int PRIMARY KEY, a int4[]);"
                     "INSERT INTO grid SELECT g, ARRAY[g, -g] FROM generate_series(1, 3000) g;"
                     "UPDATE grid SET a = '{{1,2},{3,4}}' WHERE id = 2999;"
                     "CREATE PUBLICATION arrays FOR TABLE grid")
        with caplog.at_level(logging.WARNING, logger="cdc_apply.snapshot"):
            copied = drain(config, spark).snapshots
        assert [(s.table, s.rows, s.method) for s in copied] == [("public.grid", 3000, "key order")]
        assert "public.grid: copied by the driver instead of Spark's tasks (cdc_apply: this copy needs the driver's " \
               "conversion" in caplog.text
        frame = spark.read.format("delta").load(f"{warehouse}/public/grid")
        assert frame.schema["a"].dataType.simpleString() == "string"
        truth = dict(conn.execute("SELECT id, a::text FROM grid").fetchall())
        assert {row.id: row.a for row in frame.collect()} == truth


def test_the_tasks_write_the_files_only_where_delta_s_writer_adds_nothing(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``snapshot.file_writer: tasks`` falls back to Delta's writer for what that writer enforces or
    fills in, and for layouts the tasks do not write."""
    tables = {
        "plain": ("(id bigint, `a b` string)", "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')"),
        "checked": ("(id bigint, v int)", ""),
        "generated": ("(id bigint, twice bigint GENERATED ALWAYS AS (id * 2))", ""),
        "partitioned": ("(id bigint, region string)", "PARTITIONED BY (region)"),
        "nested": ("(id bigint, s struct<x: int>)", ""),
        "nested_mapped": ("(id bigint, s struct<x: int>)", "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')"),
    }
    for name, (columns, extra) in tables.items():
        spark.sql(f"CREATE TABLE delta.`{tmp_path / name}` {columns} USING delta {extra}")
    spark.sql(f"ALTER TABLE delta.`{tmp_path / 'checked'}` ADD CONSTRAINT positive CHECK (v > 0)")
    takes = {name: Target(spark, str(tmp_path / name), False).open_file_append() is not None for name in tables}
    assert takes == {"plain": True, "checked": False, "generated": False, "partitioned": False, "nested": True,
                     "nested_mapped": False}
    plain = Target(spark, str(tmp_path / "plain"), False).open_file_append()
    assert plain is not None and plain.physical_columns["a b"][0].startswith("col-")  # column mapping's names
    assert Target(spark, "s3a://bucket/t", False).open_file_append() is None
