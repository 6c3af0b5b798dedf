"""Shared fixtures: throwaway PostgreSQL servers (one per version found) and one Spark session."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest

from cdc_apply.pgserver import PgServer, available_bindirs
from tests import cpu_budget

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


# The three longest crash drills. With two workers (./dev test's default), one worker starts with the
# longest and the other with the next two, so none of them ends up last.
LONGEST_FIRST = ("tests/test_stream_crash.py", "tests/test_object_store.py::test_kill_9_of_run_follow",
                 "tests/test_changelog_crash.py")

# Child processes (CLI jobs, spark-submit, the notebook's and Airflow's tasks: JVMs that live seconds
# to minutes) start about a third faster with the JIT's first tier only; the shared session below
# runs for the whole suite and keeps the full JIT (with the first tier only the suite was slower).
# The serial collector: a short job's heap stays small, and G1's concurrent threads cost a cold
# stream job 2-3% more CPU alone and 9% beside a busy second test worker (measured 2026-11-28).
CHILD_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", CHILD_JVM_OPTIONS)


# The layers (docs/testing.md): marked here by the fixtures a test uses; a test that starts a server
# or a Spark job of its own carries its mark itself.
PG_FIXTURES = {"pg_server", "pg18", "any_db", "db18"}


def mark_layers(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        crash = item.get_closest_marker("crash") is not None
        if "spark" in names or crash:
            item.add_marker(pytest.mark.spark)
        if names & PG_FIXTURES or crash:
            item.add_marker(pytest.mark.pg)


@pytest.fixture(autouse=True)
def layer_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the ``pg`` mark cannot start a PostgreSQL server, and one without ``spark`` cannot
    start a JVM, in its own process or a child: a missing mark fails the test instead of hiding a
    server in the fast layer."""
    marks = {mark.name for mark in request.node.iter_markers()}
    if "spark" not in marks:
        monkeypatch.setenv("JAVA_HOME", "/nonexistent/the-test-is-not-marked-spark")
    if "pg" not in marks:
        def refuse(self: PgServer, *args: object, **kwargs: object) -> PgServer:
            raise AssertionError(f"{request.node.nodeid} starts PostgreSQL: mark it pytest.mark.pg")

        monkeypatch.setattr(PgServer, "start", refuse)
        monkeypatch.setenv("CDC_APPLY_PG_BINDIR", "/nonexistent/the-test-is-not-marked-pg")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(cpu_budget, "cpu_budget")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_layers(items)
    longest = [next((i for i in items if i.nodeid.startswith(path)), None) for path in LONGEST_FIRST]
    # The tests of a Connect server (``connect_with_s3``, one per worker) together, so one worker
    # starts one: each start costs about a minute of CPU.
    connect = [i for i in items if i not in longest and "connect_with_s3" in getattr(i, "fixturenames", ())]
    rest = [i for i in items if i not in longest and i not in connect]
    first, second = [i for i in longest if i is not None][:1], [i for i in longest if i is not None][1:]
    # xdist's worksteal hands the first worker items[:len // 2] and the second the rest, and steals
    # from the ends of those lists: ``second`` and then the Connect tests go at the head of the
    # second worker's half, where nothing is stolen.
    split = max(0, len(items) // 2 - len(first))
    items[:] = first + rest[:split] + second + connect + rest[split:]


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


# The settings of the tests' own long-lived Spark JVMs: the shared sessions and the Connect servers.
TEST_SERVER_CONF = {"spark.driver.extraJavaOptions": "-XX:+UseParallelGC", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}


@contextlib.contextmanager
def long_lived_jvm() -> Iterator[None]:
    """Around the start of a long-lived JVM of the tests' own (a shared session, a Connect server): not
    the short jobs' options (``CHILD_JVM_OPTIONS``: the JIT's first tier, the serial collector),
    whose collector would clash with ``TEST_SERVER_CONF``'s."""
    with pytest.MonkeyPatch.context() as env:
        if os.environ.get("SPARK_SUBMIT_OPTS") == CHILD_JVM_OPTIONS:  # ours, not the caller's
            env.delenv("SPARK_SUBMIT_OPTS")
        yield


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    from cdc_apply.spark import build_spark_session

    with long_lived_jvm():
        # The parallel collector: 10-20% less JVM CPU per small MERGE than G1 in a warm session
        # (2.7-3.1 s against 3.3-3.8 s, three rounds of ten each, 2026-11-29); the tests' two shared
        # sessions spend about half of the suite's CPU.
        # Interpreted expressions instead of generated code (Spark's own switch for testing both
        # paths): 13% less JVM CPU per small MERGE in a warm session (240 s against 275 s for 80,
        # 2026-11-29). The tests' Connect servers, also long-lived and busy with small MERGEs, run
        # the same way (TEST_SERVER_CONF). The jobs the tests start (CLI verbs, drills, spark-submit)
        # run generated code, as a user's do.
        session = build_spark_session(TEST_SERVER_CONF)
    cpu_budget.shared_jvm_pid = session.sparkContext._gateway.proc.pid
    yield session
    session.stop()


@pytest.fixture(scope="session")
def connect_with_s3():  # type: ignore[no-untyped-def]
    """One Spark Connect server per test worker, for every test that needs one (the Connect module's,
    the notebook's), with the settings that reach an S3 server of its own: each Connect server the
    tests start costs about a minute of CPU before it serves anything."""
    from cdc_apply.s3server import S3Server
    from cdc_apply.spark.connect_server import ConnectServer

    with S3Server() as s3:
        with long_lived_jvm():
            server = ConnectServer({"spark.master": "local[2]", **TEST_SERVER_CONF, **s3.spark_conf()}).start()
        started = server._process
        with server:
            assert server._process is started  # a started server used as a context manager: not started again
            yield server, s3
        assert started is not None and started.poll() is not None  # and stopped with it
        assert not server.log.exists()  # a log is kept only after a failure
    assert not s3.log.exists() and not s3.root.exists()


def _delta_rs_counts() -> tuple[int, dict[str, list[str]]]:
    import sys

    oracle = sys.modules.get("tests.delta_oracle")
    if oracle is None:
        return 0, {}
    return oracle.delta_rs_reads[0], {path: sorted(found) for path, found in oracle.delta_rs_left_out.items()}


_worker_counts: list[tuple[int, dict[str, list[str]]]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: hand the counts to the controller
        session.config.workeroutput["delta_rs"] = _delta_rs_counts()  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    counts = getattr(node, "workeroutput", {}).get("delta_rs")
    if counts is not None:
        _worker_counts.append(counts)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """How many oracle reads delta-rs made beside Spark, and which targets it could not read."""
    reads, left_out = _delta_rs_counts()
    for worker_reads, worker_left_out in _worker_counts:
        reads += worker_reads
        left_out.update(worker_left_out)
    if reads or left_out:
        features = sorted({f for found in left_out.values() for f in found})
        terminalreporter.write_line(f"delta-rs: {reads} oracle reads equal to Spark's; "
                                    f"{len(left_out)} target(s) left out for {features}")
