"""Shared fixtures: throwaway PostgreSQL servers (one per version found) and one Spark session."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import psycopg
import pytest

from cdc_apply.pgserver import PgServer, available_bindirs

SERVERS = available_bindirs()
_db_numbers = itertools.count()


@pytest.fixture(scope="session", params=sorted(SERVERS))
def pg_server(request: pytest.FixtureRequest) -> Iterator[PgServer]:
    """Every PostgreSQL version on this machine: embedded 18 always, Debian 15 when installed."""
    server = PgServer(bindir=SERVERS[request.param]).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg18() -> Iterator[PgServer]:
    server = PgServer(bindir=SERVERS["pg18"]).start()
    try:
        yield server
    finally:
        server.stop()


def fresh_database(server: PgServer) -> Iterator[tuple[PgServer, str]]:
    name = f"t{next(_db_numbers)}"
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield server, name
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                          (name,))
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture()
def any_db(pg_server: PgServer) -> Iterator[tuple[PgServer, str]]:
    """A fresh database on each server version."""
    yield from fresh_database(pg_server)


@pytest.fixture()
def db18(pg18: PgServer) -> Iterator[tuple[PgServer, str]]:
    yield from fresh_database(pg18)


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    from cdc_apply.spark import build_spark_session

    session = build_spark_session()
    yield session
    session.stop()


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """How many oracle reads delta-rs made beside Spark, and which targets it could not read."""
    import sys

    oracle = sys.modules.get("tests.delta_oracle")
    if oracle is None:
        return
    delta_rs_left_out, delta_rs_reads = oracle.delta_rs_left_out, oracle.delta_rs_reads
    if delta_rs_reads[0] or delta_rs_left_out:
        features = sorted({f for found in delta_rs_left_out.values() for f in found})
        terminalreporter.write_line(f"delta-rs: {delta_rs_reads[0]} oracle reads equal to Spark's; "
                                    f"{len(delta_rs_left_out)} target(s) left out for {features}")
