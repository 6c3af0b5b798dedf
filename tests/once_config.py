"""The config the run --once oracle tests share: a slot and a FOR ALL TABLES publication named after
the pipeline, created on the first run, and a warehouse."""

from __future__ import annotations

from typing import Any

from cdc_apply.config import Config, parse_config
from cdc_apply.pgserver import PgServer


def once_config(server: PgServer, dbname: str, warehouse: str, pipeline: str, **sections: Any) -> Config:
    return parse_config({"pipeline": pipeline, "source": {"dsn": server.conninfo(dbname), "slot": pipeline,
                                                          "create_publication": True},
                         "target": {"warehouse": warehouse}, **sections})
