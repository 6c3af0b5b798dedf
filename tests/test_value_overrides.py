"""Values a column's mapped type cannot hold (NaN in numeric(p,s), a 2-D array): the error names the
config key that keeps them, committed data stays, and with ``columns.<c>.type: string`` the
pipeline carries on, the existing target column rewritten to PostgreSQL's exact text."""

from __future__ import annotations

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.errors import CdcApplyError
from cdc_apply.pgtypes import TypeCache
from cdc_apply.pipeline import drain
from tests.delta_oracle import delta_rows, source_types
from tests.once_config import once_config
from tests.reference_apply import postgres_rows

COLUMNS = ["id", "amount", "tags"]


def _config(server, dbname: str, warehouse: str, overrides: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    return once_config(server, dbname, warehouse, "ov", tables={"public.m": {"columns": overrides}} if overrides else {})


@pytest.mark.spark
def test_nan_and_2d_arrays_are_kept_as_text_once_the_config_says_so(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    path = f"{warehouse}/public/m"
    plain = _config(server, dbname, warehouse)
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int PRIMARY KEY, amount numeric(5,2), tags text[])")
        drain(plain, spark)
        conn.execute("""INSERT INTO m VALUES (1, 1.50, '{a,b}'), (2, -0.01, '{"x y",NULL,"q\\"uote",""}'),
                        (5, NULL, NULL)""")
        drain(plain, spark)
        assert delta_rows(spark, path, ["id", "amount"], source_types(conn, "public.m")) == \
            postgres_rows(conn, "public.m", ["id", "amount"])
        arrays = {r.id: r.tags for r in spark.read.format("delta").load(path).collect()}
        assert arrays == {1: ["a", "b"], 2: ["x y", None, 'q"uote', ""], 5: None}

        conn.execute("INSERT INTO m VALUES (3, 'NaN', '{c}')")
        with pytest.raises(CdcApplyError) as raised:
            drain(plain, spark)
        assert 'column \'amount\' (numeric): numeric value NaN does not fit' in str(raised.value)
        assert 'set tables."public.m".columns."amount".type: string in the config' in str(raised.value)
        assert spark.read.format("delta").load(path).count() == 3  # what was committed stays

        kept = _config(server, dbname, warehouse, {"amount": {"type": "string"}, "tags": {"type": "string"}})
        drain(kept, spark)  # the failed batch again: the columns are rewritten as text, then it applies
        conn.execute("INSERT INTO m VALUES (4, 'NaN', '{{1,2},{3,4}}')")
        conn.execute("UPDATE m SET amount = 2.25, tags = '{{\"a b\"},{NULL}}' WHERE id = 1")
        drain(kept, spark)
        types = spark.read.format("delta").load(path).schema
        assert types["amount"].dataType.simpleString() == "string" and types["tags"].dataType.simpleString() == "string"
        text = TypeCache().get(25)
        as_text = {"id": source_types(conn, "public.m")["id"], "amount": text, "tags": text}
        assert delta_rows(spark, path, COLUMNS, as_text) == postgres_rows(conn, "public.m", COLUMNS)


def test_column_type_override_is_validated() -> None:
    from cdc_apply.config import ConfigError

    with pytest.raises(ConfigError, match=r'tables."public.m".columns.amount.type: must be one of'):
        parse_config({"tables": {"public.m": {"columns": {"amount": {"type": "decimal"}}}}})


@pytest.mark.spark
def test_evolve_switches_a_column_to_text_by_itself(db18, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under ``schema_policy: evolve``, NaN in numeric(p,s) and a 2-D array, in the copy and in the stream,
    switch their column to PostgreSQL's text by themselves (the target column rewritten in place,
    recorded in the data commit and the run summary); under the default policy the run stops naming
    the config key, nothing of the batch committed. A new run (a fresh applier) converts as the
    target holds them."""
    from cdc_apply.replay import print_summary

    server, dbname = db18
    warehouse = str(tmp_path / "wh")
    evolve = once_config(server, dbname, warehouse, "ev", defaults={"schema_policy": "evolve"})
    text = TypeCache().get(25)
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int PRIMARY KEY, amount numeric(5,2), tags text[])")
        conn.execute("CREATE TABLE copied (id int PRIMARY KEY, amount numeric(5,2), tags text[])")
        conn.execute("INSERT INTO m VALUES (1, 1.50, '{a,b}'), (2, NULL, '{\"x y\",NULL}')")
        conn.execute("INSERT INTO copied VALUES (1, 'NaN', '{{1,2},{3,4}}'), (2, 2.5, '{q}')")  # in the copy
        summary = drain(evolve, spark)
        conn.execute("INSERT INTO m VALUES (3, 'NaN', '{c}')")
        conn.execute("UPDATE m SET tags = '{{\"a b\"},{NULL}}' WHERE id = 1")
        conn.execute("INSERT INTO copied VALUES (3, -1.25, '{}')")
        summary.batches += drain(evolve, spark).batches
        for table in ("m", "copied"):
            path = f"{warehouse}/public/{table}"
            types = spark.read.format("delta").load(path).schema
            assert [types[c].dataType.simpleString() for c in ("amount", "tags")] == ["string", "string"], table
            as_text = {"id": source_types(conn, f"public.{table}")["id"], "amount": text, "tags": text}
            assert delta_rows(spark, path, COLUMNS, as_text) == postgres_rows(conn, f"public.{table}", COLUMNS)
        history = spark.sql(f"DESCRIBE HISTORY delta.`{warehouse}/public/m`").collect()
        assert any('"text_columns": ["amount", "tags"]' in (h.userMetadata or "") for h in history)
        out = __import__("io").StringIO()
        print_summary(summary.batches, out)
        assert "columns kept as PostgreSQL's text, since a value did not fit their type: amount, tags" in out.getvalue()

        conn.execute("INSERT INTO m VALUES (4, 7.25, '{d,e}')")  # a new run: the target says which columns are text
        drain(evolve, spark)
        as_text = {"id": source_types(conn, "public.m")["id"], "amount": text, "tags": text}
        assert delta_rows(spark, f"{warehouse}/public/m", COLUMNS, as_text) == postgres_rows(conn, "public.m", COLUMNS)

        # The default policy stops at a 2-D array too, naming the key; the committed rows stay.
        plain = once_config(server, dbname, str(tmp_path / "plain"), "pl", defaults={"include": False},
                            tables={"public.n": {}})
        conn.execute("CREATE TABLE n (id int PRIMARY KEY, tags text[])")
        conn.execute("INSERT INTO n VALUES (1, '{a}')")
        drain(plain, spark)
        conn.execute("INSERT INTO n VALUES (2, '{{a,b},{c,d}}')")
        with pytest.raises(CdcApplyError) as raised:
            drain(plain, spark)
        assert 'set tables."public.n".columns."tags".type: string in the config' in str(raised.value)
        assert spark.read.format("delta").load(str(tmp_path / "plain" / "public" / "n")).count() == 1
