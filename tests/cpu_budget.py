"""Where the suite's CPU goes, test by test (docs/testing.md, "The budget"): the CPU each test cost
the worker's shared Spark session (its JVM), the worker's own Python, and the child processes it
waited for. Printed at the end of a run, the costliest tests first. A child's own children that it
did not wait for (a CLI job's JVM, a server) are not counted: the wall time shows those."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest

shared_jvm_pid: int | None = None  # the shared session's JVM, set by the ``spark`` fixture
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SHOWN = 25

# (test id, wall s, shared JVM CPU s, own CPU s, children's CPU s, the worker, when the test ended:
# CLOCK_MONOTONIC, the same clock in every process of the machine)
Record = tuple[str, float, float, float, float, str, float]
_started = time.monotonic()
_records: list[Record] = []
_from_workers: list[Record] = []


def _jvm_cpu() -> float:
    if shared_jvm_pid is None:
        return 0.0
    try:
        with open(f"/proc/{shared_jvm_pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _process_cpu() -> tuple[float, float]:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    started, jvm = time.monotonic(), _jvm_cpu()
    own, children = _process_cpu()
    yield
    own_after, children_after = _process_cpu()
    ended = time.monotonic()
    _records.append((item.nodeid, ended - started, _jvm_cpu() - jvm, own_after - own, children_after - children,
                     os.environ.get("PYTEST_XDIST_WORKER", "main"), ended))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: hand them to the controller
        session.config.workeroutput["cpu_budget"] = _records  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _from_workers.extend(tuple(record) for record in getattr(node, "workeroutput", {}).get("cpu_budget", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    records = _records + _from_workers
    if not records:
        return
    total = [sum(r[i] for r in records) for i in range(1, 5)]  # type: ignore[misc]
    write = terminalreporter.write_line
    write(f"CPU by test: {len(records)} tests, {total[0]:,.0f} s of test time; shared Spark sessions "
          f"{total[1]:,.0f} s, the tests' Python {total[2]:,.0f} s, waited-for children {total[3]:,.0f} s")
    write(f"{'CPU s':>7} {'JVM s':>7} {'own s':>6} {'kids s':>6} {'wall s':>7}  the {SHOWN} costliest tests")
    for nodeid, wall, jvm, own, children, _, _ in sorted(records, key=lambda r: -(r[2] + r[3] + r[4]))[:SHOWN]:
        write(f"{jvm + own + children:7.1f} {jvm:7.1f} {own:6.1f} {children:6.1f} {wall:7.1f}  {nodeid}")
    # How evenly the workers shared the run: a worker that ends long before the other left a core to it.
    for worker in sorted({r[5] for r in records}):
        mine = [r for r in records if r[5] == worker]
        write(f"worker {worker}: {len(mine)} tests, {sum(r[1] for r in mine):,.0f} s of test time, "
              f"its last test ended {max(r[6] for r in mine) - _started:,.0f} s into the run")
