"""Process-wide settings for the processes cdc_apply owns (the CLI, the spark-submit jobs), the
stop flag their signals set, and waiting for a streaming query under it."""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql.streaming import StreamingQuery

GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Collect the young generation every 50,000 allocations instead of 700.

    Decoding keeps about two objects per row change alive until its batch is applied, so with
    the default threshold the collector walks the growing batch again and again: measured at
    20-40% of decode time in ``cdc-apply bench decode``. Nothing cdc_apply builds has cycles
    that need prompt collection. Library users (the Spark data source) keep their own settings.
    """
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)


class StopFlag:
    """Set by SIGTERM/SIGINT; a runner stops after the current batch."""

    def __init__(self) -> None:
        self.event = threading.Event()

    @contextmanager
    def on_signals(self) -> Iterator[StopFlag]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, lambda *_: self.event.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def await_query(query: StreamingQuery, stop: StopFlag, tick: Callable[[], None] | None = None) -> None:
    """Until ``query`` ends (available_now) or a stop is asked, when the running micro-batch commits
    first; ``tick`` is called every half second meanwhile. Raises the query's error."""
    while query.isActive:
        if stop.event.wait(0.5):
            while query.status["isTriggerActive"]:
                time.sleep(0.2)
            query.stop()
            break
        if tick is not None:
            tick()
    if query.exception() is not None:
        raise query.exception()  # type: ignore[misc]
