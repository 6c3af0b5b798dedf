"""`cdc-apply demo`: embedded PostgreSQL 18 -> a realistic workload -> pgoutput -> change rows in Delta.

Until the MERGE apply lands (issue 4), the demo lands the typed change rows of each table in a
Delta change-log table at <warehouse>/<schema>/<table>__changes and prints them. Nothing is
pre-recorded: every row printed was decoded from the live server's slot in this run.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter

import psycopg

from cdc_apply.assemble import Assembler
from cdc_apply.changes import ChangeRowBuilder
from cdc_apply.lsn import format_lsn
from cdc_apply.pgserver import PgServer
from cdc_apply.sources.slot import PgOutputOptions, create_slot, read_changes

SETUP = """
CREATE TABLE customers (id int PRIMARY KEY, name text NOT NULL, email text, notes text);
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id int, amount numeric(12,2), placed timestamptz);
CREATE PUBLICATION demo_pub FOR TABLE customers, orders;
"""
WORKLOAD = [
    "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com', NULL), (2, 'Grace', 'grace@example.com', NULL)",
    "INSERT INTO orders SELECT g, 1 + g % 2, g * 10.5, now() FROM generate_series(1, 5) g",
    # A TOAST value (~20 kB), then an update of another column: the big value is sent as 'unchanged'.
    "UPDATE customers SET notes = (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 600) g) WHERE id = 1",
    "UPDATE customers SET email = 'ada@lovelace.org' WHERE id = 1",
    "UPDATE customers SET id = 20 WHERE id = 2",  # an update that changes the key
    "TRUNCATE orders",
    "INSERT INTO orders VALUES (100, 1, 99.99, now())",
    "ALTER TABLE customers ADD COLUMN tier text",
    "INSERT INTO customers VALUES (3, 'Edsger', NULL, NULL, 'gold')",
    "DELETE FROM customers WHERE id = 20",
]


def run_demo(warehouse: str | None = None) -> None:
    from cdc_apply.apply import build_spark_session

    warehouse = warehouse or tempfile.mkdtemp(prefix="cdc_apply_demo_")
    started = time.perf_counter()
    print("1/4 starting an embedded PostgreSQL 18 with wal_level=logical ...", flush=True)
    with PgServer() as server, psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(SETUP)
        create_slot(conn, "demo")
        print(f"2/4 running the workload ({len(WORKLOAD)} statements) ...", flush=True)
        for statement in WORKLOAD:
            conn.execute(statement)
        raws = list(read_changes(conn, "demo", PgOutputOptions(("demo_pub",), proto_version=2, streaming="on")))
        source = {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                  for table in ("customers", "orders")}

    print(f"3/4 decoding {len(raws)} pgoutput messages "
          f"({format_lsn(raws[0].lsn)} .. {format_lsn(raws[-1].lsn)}) ...", flush=True)
    transactions = list(Assembler().transactions(raws))
    segments = ChangeRowBuilder().build(transactions)

    print(f"4/4 writing change rows to Delta under {warehouse} ...", flush=True)
    spark = build_spark_session()
    ops: Counter[tuple[str, str]] = Counter()
    for segment in segments:
        frame = spark.createDataFrame(segment.to_arrow())
        path = f"{warehouse}/{segment.relation.namespace}/{segment.relation.name}__changes"
        frame.write.format("delta").mode("append").option("mergeSchema", "true").save(path)
        ops.update((segment.qualified_name, row["op"]) for row in segment.rows)
    for table in ("customers", "orders"):
        path = f"{warehouse}/public/{table}__changes"
        print(f"\n== public.{table}: change rows in Delta ({path}); source now has {source[table]} rows")
        (spark.read.format("delta").load(path)
         .selectExpr("commit_lsn", "seq", "op", "to_json(key) AS key", "substr(to_json(new), 1, 70) AS new",
                     "unchanged")
         .orderBy("commit_lsn", "seq").show(truncate=False))
    print("run summary:")
    print(f"  transactions {len(transactions)}, messages {len(raws)}, "
          f"LSN {format_lsn(raws[0].lsn)} .. {format_lsn(raws[-1].lsn)}, {time.perf_counter() - started:.1f} s")
    for (table, op), count in sorted(ops.items()):
        print(f"  {table:20s} {op}: {count}")
    spark.stop()
