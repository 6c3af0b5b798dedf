"""docs/getting-started.md, followed as written: a server that is not the embedded one (Debian's
PostgreSQL 15 when installed), a role that is not a superuser, the grants and the publication the
page names, the page's config, `validate`, `run --once` twice with changes between, `status`; every
target equal to PostgreSQL, read by Spark and by delta-rs."""

from __future__ import annotations

import json
import os

import psycopg
import pytest

from cdc_apply.pgserver import PgServer, available_bindirs
from tests.delta_oracle import delta_rows, source_types
from tests.reference_apply import postgres_rows
from tests.test_decode_cli import _cli, _cli_here

TABLES = {"public.orders": ["id", "customer", "total", "placed"], "public.customers": ["id", "name", "country"]}


@pytest.mark.spark
@pytest.mark.pg
def test_the_getting_started_page_reaches_equal_tables_as_a_non_superuser(spark, tmp_path, capsys,
                                                                          monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bindirs = available_bindirs()
    with PgServer(bindir=bindirs.get("pg15", bindirs["pg18"])) as server, \
            psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute("CREATE DATABASE shop")
        with psycopg.connect(server.conninfo("shop"), autocommit=True) as owner:
            owner.execute("CREATE TABLE customers (id int PRIMARY KEY, name text, country text)")
            owner.execute("CREATE TABLE orders (id bigint PRIMARY KEY, customer int, total numeric(10,2), "
                          "placed timestamptz)")
            owner.execute("INSERT INTO customers SELECT g, 'c' || g, 'NL' FROM generate_series(1, 50) g")
            owner.execute("INSERT INTO orders SELECT g, g % 50 + 1, g * 1.25, now() FROM generate_series(1, 500) g")
            # Step 2 of the page, as written there.
            owner.execute("CREATE ROLE cdc_apply LOGIN REPLICATION PASSWORD 'not-shown'")
            owner.execute("GRANT SELECT ON public.orders, public.customers TO cdc_apply")
            owner.execute("CREATE PUBLICATION orders_pub FOR TABLE public.orders, public.customers")
            config = tmp_path / "shop.yaml"
            warehouse = tmp_path / "lake"
            config.write_text(f"""pipeline: shop
source:
  host: 127.0.0.1
  port: {server.port}
  dbname: shop
  user: cdc_apply
  password_env: SHOP_PG_PASSWORD
  slot: shop_cdc
  publication: orders_pub
target:
  warehouse: {warehouse}
""")
            env = {**os.environ, "SHOP_PG_PASSWORD": "not-shown"}
            validated = _cli("validate", str(config), env=env)
            assert validated.returncode == 0, validated.stdout + validated.stderr
            first = _cli("run", "--config", str(config), "--once", env=env)
            assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
            assert "snapshot public.orders: 500 rows at " in first.stdout, first.stdout
            assert "not-shown" not in first.stdout + first.stderr
            owner.execute("UPDATE orders SET total = total + 1 WHERE id % 7 = 0")
            owner.execute("DELETE FROM orders WHERE id % 11 = 0")
            owner.execute("INSERT INTO customers VALUES (51, 'new', 'BE')")
            owner.execute("UPDATE customers SET country = 'DE' WHERE id = 3")
            # The second run in this process (a new one costs a JVM): the CLI's main on the tests' session.
            monkeypatch.setenv("SHOP_PG_PASSWORD", "not-shown")
            code, out, err = _cli_here(capsys, "run", "--config", str(config), "--once")
            assert code == 0, out[-3000:] + err[-3000:]
            assert "public.orders" in out and "not-shown" not in out + err
            status = _cli("status", "--config", str(config), env=env)
            assert status.returncode == 0, status.stdout + status.stderr
            report = json.loads(status.stdout)
            assert report["slot"]["wal_status"] in ("reserved", "extended"), report
            # The first run created the tables with cdc_apply's default of deletion vectors: the second
            # run's MERGE marked rows of the copy's files instead of rewriting them, and delta_rows read
            # them through delta-rs too.
            orders_log = warehouse / "public" / "orders" / "_delta_log"
            assert any('"deletionVector"' in commit.read_text() for commit in orders_log.glob("*.json"))
            for name, columns in TABLES.items():
                assert delta_rows(spark, f"{warehouse}/{name.replace('.', '/')}", columns,
                                  source_types(owner, name)) == postgres_rows(owner, name, columns), name
