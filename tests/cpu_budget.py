"""Where the suite's CPU goes, test by test (docs/testing.md, "The budget"): the CPU each test cost
the worker's shared Spark session (its JVM), the worker's own Python, and the child processes it
waited for. Printed at the end of a run, the costliest tests first. A child's own children that it
did not wait for (a CLI job's JVM, a server) are not counted: the wall time shows those."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

shared_jvm_pid: int | None = None  # the shared session's JVM, set by the ``spark`` fixture
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SHOWN = 25


class Record(NamedTuple):
    nodeid: str
    wall: float
    jvm: float  # the shared session's JVM CPU, s
    own: float  # the worker's own CPU, s
    children: float  # the CPU of the children it waited for, s
    worker: str
    ended: float  # CLOCK_MONOTONIC: the same clock in every process of the machine

    @property
    def cpu(self) -> float:
        return self.jvm + self.own + self.children


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
    _records.append(Record(item.nodeid, ended - started, _jvm_cpu() - jvm, own_after - own, children_after - children,
                           os.environ.get("PYTEST_XDIST_WORKER", "main"), ended))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: hand them to the controller
        # As plain tuples: what crosses to the controller is serialized by execnet, which knows no classes.
        session.config.workeroutput["cpu_budget"] = [tuple(r) for r in _records]  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _from_workers.extend(Record(*record) for record in getattr(node, "workeroutput", {}).get("cpu_budget", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    records = _records + _from_workers
    if not records:
        return
    total = [sum(getattr(r, name) for r in records) for name in ("wall", "jvm", "own", "children")]
    write = terminalreporter.write_line
    write(f"CPU by test: {len(records)} tests, {total[0]:,.0f} s of test time; shared Spark sessions "
          f"{total[1]:,.0f} s, the tests' Python {total[2]:,.0f} s, waited-for children {total[3]:,.0f} s")
    write(f"{'CPU s':>7} {'JVM s':>7} {'own s':>6} {'kids s':>6} {'wall s':>7}  the {SHOWN} costliest tests")
    for r in sorted(records, key=lambda r: -r.cpu)[:SHOWN]:
        write(f"{r.cpu:7.1f} {r.jvm:7.1f} {r.own:6.1f} {r.children:6.1f} {r.wall:7.1f}  {r.nodeid}")
    # How evenly the workers shared the run: a worker that ends long before the other left a core to it.
    for worker in sorted({r.worker for r in records}):
        mine = [r for r in records if r.worker == worker]
        write(f"worker {worker}: {len(mine)} tests, {sum(r.wall for r in mine):,.0f} s of test time, "
              f"its last test ended {max(r.ended for r in mine) - _started:,.0f} s into the run")
