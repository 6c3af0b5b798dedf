"""The unit every source yields: one raw pgoutput message with its LSN and xid."""

from __future__ import annotations

from dataclasses import dataclass


# Not frozen: one is made per message received, and a frozen dataclass's __init__ costs about 3x.
@dataclass(slots=True)
class RawMessage:
    lsn: int
    xid: int | None
    data: bytes
    source: str | None = None  # "file.jsonl:LINE" or similar, for error messages
    type_facts: str | None = None  # a Type message's catalog facts, as a capture recorded them (pgtypes/user.py)
