"""Source connections bounded in time on the client's side: a health check on a connection whose
peer acknowledges every byte and answers nothing (the loopback proxy stalled) fails within its
bound, as a lost connection the runner reconnects from, instead of blocking the pipeline."""

from __future__ import annotations

import time

import psycopg
import pytest

from cdc_apply.config import parse_config
from cdc_apply.sources.health import HealthCheckTimeout, HealthMonitor
from cdc_apply.sources.slot import create_slot
from tests.tcp_proxy import StallingProxy


def test_a_health_check_on_a_stalled_connection_fails_within_its_bound(db18) -> None:  # type: ignore[no-untyped-def]
    server, dbname = db18
    with psycopg.connect(server.conninfo(dbname), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        create_slot(conn, "bounded")
    proxy = StallingProxy(server.port)
    try:
        config = parse_config({"source": {"dsn": f"host=127.0.0.1 port={proxy.port} user=postgres dbname={dbname}",
                                          "slot": "bounded", "publication": "p"}})
        monitor = HealthMonitor(config.source)
        monitor.timeout_seconds = 2.0
        with psycopg.connect(config.source.conninfo(), autocommit=True) as conn:
            assert monitor.check(conn).exists  # answered through the proxy
            proxy.stall()
            started = time.monotonic()
            with pytest.raises(HealthCheckTimeout, match=rf"no answer from 127.0.0.1:{proxy.port} in 2 s"):
                monitor.check(conn)
            assert time.monotonic() - started < 8
            assert isinstance(HealthCheckTimeout("x"), psycopg.OperationalError)  # the reconnect path's error
    finally:
        proxy.close()
