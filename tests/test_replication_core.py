"""The replication core's receive-while-writing mode (``ReplicationCore.start_write``), on a real
capture: the next batch is received while one is written, a write is confirmed only once it is
durable, one write runs at a time, and a failed write confirms nothing.

The sink here is the core's own port (``cdc_apply.replication.Sink``), held open by the test so
the moments between "written" and "durable" can be looked at; the Delta sink behind it is tested
end to end by test_live.py and the crash drills (tests/test_crash.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from cdc_apply.transactions import Transaction
from cdc_apply.replication import BatchCut, ReplicationCore
from tests.test_type_roundtrip import captured  # noqa: F401 - the module-scoped capture fixture


class _HeldSink:
    """Each write waits until the test releases it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[list[Transaction]] = []
        self.error: Exception | None = None

    def write_batch(self, batch: list[Transaction]) -> None:
        assert self.release.wait(30)
        if self.error is not None:
            raise self.error
        self.written.append(batch)


def test_the_next_batch_is_received_while_one_is_written_and_confirmed_only_once_durable(captured) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    raws = captured[3][False]
    sink = _HeldSink()
    confirmed: list[int] = []
    core = ReplicationCore(sink, confirmed.append, cut=BatchCut(max_changes=2, max_seconds=60))
    with ThreadPoolExecutor(1) as writer:
        index = 0
        while not core.pending:  # up to the first commit
            core.feed([raws[index]])
            index += 1
        assert core.write_ready(drained=True) and not core.write_ready(drained=False)  # 1 change: not due
        core.start_write(writer)
        core.feed(raws[index:])  # received and decoded while the first write is held
        assert core.pending_changes >= 2 and core.write_full() and not core.write_ready(drained=True)
        assert core.idle_position(10**12) is None  # nothing moves while a write is not durable
        assert not core.finish_write(timeout=0.1) and confirmed == []
        sink.release.set()
        assert core.finish_write(timeout=30)
        first_end = sink.written[0][-1].end_lsn
        assert confirmed == [first_end] and not core.writing
        core.start_write(writer)
        assert core.finish_write(timeout=30)
        second_end = sink.written[1][-1].end_lsn
        assert confirmed == [first_end, second_end] and second_end > first_end
        assert sum(len(b) for b in sink.written) == len([r for r in raws if r.data[:1] == b"C"])
    core.close()


def test_a_failed_write_confirms_nothing_and_raises_on_the_receiving_side(captured) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    sink = _HeldSink()
    sink.error = RuntimeError("the target refused the commit")
    sink.release.set()
    confirmed: list[int] = []
    core = ReplicationCore(sink, confirmed.append)
    core.feed(captured[3][False])
    with ThreadPoolExecutor(1) as writer:
        core.start_write(writer)
        with pytest.raises(RuntimeError, match="refused"):
            core.finish_write(timeout=30)
    assert confirmed == [] and not core.writing and core.confirmed == 0
    core.close()


def test_a_failed_write_is_named_by_its_batch_end_and_the_javas_own_line() -> None:
    """`run --follow`'s WriteFailed (docs/live.md): py4j's first line names only the JVM call made, so
    the message takes the Java exception's line after it."""
    from cdc_apply.live import WriteFailed

    py4j_like = RuntimeError("An error occurred while calling o123.sql.\n: java.net.ConnectException: "
                             "Connection refused\n\tat sun.nio.ch.Net.pollConnect(Native Method)")
    assert str(WriteFailed(0x1B8E740, py4j_like)) == \
        "the write of the batch ending at 0/1B8E740 failed: java.net.ConnectException: Connection refused"
    assert str(WriteFailed(16, RuntimeError(""))).endswith("failed: RuntimeError")
