"""Named crash points for the crash-safety tests: ``CDC_APPLY_FAILPOINT=name[:N]`` kills the process
with SIGKILL the N-th time (default 1st) it reaches ``failpoint(name)``.

Points: ``after_receive`` (frames read, not yet decoded), ``after_decode`` (transactions assembled,
not yet applied), ``between_tables`` (one table's Delta commit done, the next not started),
``before_confirm`` (every target committed, the slot not yet confirmed), ``snapshot_chunk`` (one
chunk of an initial snapshot copied, the rest not), ``between_pieces`` (a piece of a spilled
transaction written into files of its target, not committed).
Unset (the normal case) it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    spec = os.environ.get("CDC_APPLY_FAILPOINT")
    if not spec:
        return
    wanted, _, nth = spec.partition(":")
    if wanted != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
