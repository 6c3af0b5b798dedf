"""Progress for long work (initial snapshot, replays): a rich bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("cdc_apply.progress")


@contextmanager
def progress(description: str, total: int | None, unit: str = "rows") -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``. ``total`` may be an estimate (or None when unknown)."""
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                      TimeElapsedColumn(), transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
        return
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        of = f" of ~{total:,}" if total else ""
        log.info("%s: %s%s %s", description, f"{done:,}", of, unit)

    yield advance
