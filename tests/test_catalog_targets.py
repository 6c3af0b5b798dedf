"""Targets by catalog name in a persistent catalog (docs/spark.md, "Catalog targets"): Spark's own
Hive metastore on embedded Derby, which each job starts itself from its config.

- A run with ``target.name_template`` before the catalog holds the schema it names: refused, naming
  the keys; nothing created. The same process then creates the schema, and a run copies and creates
  every table by name (each JVM on the metastore costs about 20-30 s).
- A `run --once` in a new process and JVM (the names come back from the metastore) applies updates,
  deletes, inserts and an added column; a third process reads every table back by name. Each equals PostgreSQL, read
  by Spark by name and by delta-rs at the location the catalog gives.
- Spark's in-memory catalog, which forgets a table when the job ends, is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from cdc_apply.apply.targets import TargetCatalogError
from cdc_apply.pipeline import drain
from tests.delta_oracle import delta_rs_rows, source_types
from tests.once_config import once_config
from tests.reference_apply import postgres_rows
from tests.test_decode_cli import _cli

REPO = Path(__file__).resolve().parent.parent
TABLES = {"public.items": ["id", "name", "price", "note"], "public.stock": ["shop", "item", "units"]}
NAMES = {"public.items": "lake.public_items", "public.stock": "lake.public_stock"}

# Run in a process of its own with the metastore's settings: each table read by name, and where the
# catalog keeps its files.
READ_BY_NAME = """
import json, os, sys
import psycopg
from cdc_apply.spark import build_spark_session
from tests.delta_oracle import spark_rows, source_types

conf, conninfo, tables, statement, refused_config = json.loads(sys.argv[1])
spark = build_spark_session(conf, register_pgoutput=False)
found = {}
if refused_config:
    from cdc_apply.config import load_config
    from cdc_apply.errors import CdcApplyError
    from cdc_apply.pipeline import drain
    try:
        drain(load_config(refused_config), spark)
    except CdcApplyError as error:
        found["refused"] = str(error)
    found["created_when_refused"] = os.listdir(conf["spark.sql.warehouse.dir"]) if os.path.isdir(
        conf["spark.sql.warehouse.dir"]) else []
if statement:
    spark.sql(statement)
if refused_config:  # the schema exists now: the first run, copying every table by name
    found["copied"] = {s.table: s.rows for s in drain(load_config(refused_config), spark).snapshots}
with psycopg.connect(conninfo) as conn:
    for qualified, (name, columns) in tables.items():
        found[qualified] = {"rows": spark_rows(spark, name, columns, source_types(conn, qualified), by_name=True),
                            "location": spark.sql(f"DESCRIBE DETAIL {name}").first()["location"]}
spark.stop()
print("FOUND " + json.dumps(found))
"""


def _metastore_conf(directory: Path) -> dict[str, str]:
    """Spark's Hive catalog on an embedded Derby database in ``directory``."""
    return {"spark.sql.catalogImplementation": "hive",
            "spark.sql.warehouse.dir": str(directory / "hive-warehouse"),
            "spark.hadoop.javax.jdo.option.ConnectionURL":
                f"jdbc:derby:;databaseName={directory / 'metastore_db'};create=true",
            "spark.driver.extraJavaOptions": f"-Dderby.system.home={directory}",
            # Hive's session files, in java.io.tmpdir (/tmp) unless set: one directory per JVM left behind
            "spark.hadoop.hive.downloaded.resources.dir": str(directory / "hive-resources"),
            "spark.hadoop.hive.exec.local.scratchdir": str(directory / "hive-scratch")}


def _in_a_new_process(conf: dict[str, str], conninfo: str, tables: dict[str, tuple[str, list[str]]],
                      statement: str = "", refused_config: Path | None = None) -> dict[str, Any]:
    """Read ``tables`` by name in a new JVM on the metastore; first, with ``refused_config``, the error
    with which a run of it is refused (``found["refused"]``), then ``statement``, then that run again
    (``found["copied"]``: the rows each table's copy took)."""
    arguments = [conf, conninfo, tables, statement, str(refused_config) if refused_config else ""]
    run = subprocess.run([sys.executable, "-c", READ_BY_NAME, json.dumps(arguments)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("FOUND "))[len("FOUND "):])


@pytest.mark.spark
def test_targets_by_name_in_a_hive_metastore_survive_restarts(db18, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    conninfo = server.conninfo(dbname)
    conf = _metastore_conf(tmp_path)
    config = tmp_path / "catalog.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "catalog", "source": {"dsn": conninfo, "slot": "catalog", "create_publication": True},
        "target": {"warehouse": str(tmp_path / "state"), "name_template": "lake.{schema}_{table}"}, "spark": conf}))
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(10,2))")
        conn.execute("CREATE TABLE stock (shop text, item int, units int, PRIMARY KEY (shop, item))")
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, g * 1.5 FROM generate_series(1, 300) g")
        conn.execute("INSERT INTO stock SELECT s, g, g % 17 FROM generate_series(1, 100) g, "
                     "unnest(ARRAY['north', 'south']) s")

        first = _in_a_new_process(conf, conninfo, {}, statement="CREATE SCHEMA lake", refused_config=config)
        refused = str(first.get("refused"))
        assert "the target lake.public_items: its schema does not exist in the catalog" in refused, refused
        assert "target.name_template" in refused, refused
        assert first["created_when_refused"] == [], first  # nothing made by the refused run
        assert first["copied"] == {"public.items": 300, "public.stock": 200}, first

        conn.execute("UPDATE items SET price = price + 1 WHERE id % 7 = 0")
        conn.execute("DELETE FROM items WHERE id % 11 = 0")
        conn.execute("ALTER TABLE items ADD COLUMN note text DEFAULT 'new column'")
        conn.execute("INSERT INTO items VALUES (301, 'late', 9.99, 'noted')")
        conn.execute("UPDATE stock SET units = units + 100 WHERE shop = 'north'")
        conn.execute("DELETE FROM stock WHERE item > 90")
        again = _cli("run", "--config", str(config), "--once")
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

        found = _in_a_new_process(conf, conninfo, {q: (NAMES[q], columns) for q, columns in TABLES.items()})
        for qualified, columns in TABLES.items():
            truth = [list(row) for row in postgres_rows(conn, qualified, columns)]
            assert found[qualified]["rows"] == truth, qualified
            location = str(found[qualified]["location"]).removeprefix("file:")
            # The catalog's managed location, under the metastore's warehouse, not the pipeline's.
            assert location.startswith(str(tmp_path / "hive-warehouse" / "lake.db")), location
            by_delta_rs = delta_rs_rows(location, columns, source_types(conn, qualified))
            assert by_delta_rs is not None and [list(row) for row in by_delta_rs] == truth, qualified
    assert not (tmp_path / "state" / "public").exists()  # nothing written by path


def test_spark_s_in_memory_catalog_is_refused_for_targets_by_name(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO items VALUES (1, 'one')")
    config = once_config(server, dbname, str(tmp_path / "wh"), "memory",
                         target={"warehouse": str(tmp_path / "wh"), "name_template": "lake.{schema}_{table}"})
    with pytest.raises(TargetCatalogError, match=r"lake\.public_items is a catalog table, and this Spark session's "
                                                 r"catalog is Spark's in-memory one"):
        drain(config, spark)
    assert not spark.catalog.tableExists("lake.public_items")
