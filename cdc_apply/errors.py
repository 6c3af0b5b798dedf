"""The exception types cdc_apply raises. Every message names the place: file, LSN, byte offset, key."""

from __future__ import annotations


class CdcApplyError(Exception):
    """Base of every error cdc_apply reports to its user."""


class DecodeError(CdcApplyError):
    """A malformed, truncated or unknown pgoutput message (or a change for an unknown relation)."""

    def __init__(self, reason: str, *, tag: str | None = None, offset: int | None = None,
                 lsn: str | None = None, source: str | None = None) -> None:
        self.reason = reason
        self.tag = tag
        self.offset = offset
        self.lsn = lsn
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.source is not None:
            where.append(self.source)
        if self.lsn is not None:
            where.append(f"LSN {self.lsn}")
        if self.tag is not None:
            where.append(f"message {self.tag!r}")
        if self.offset is not None:
            where.append(f"byte offset {self.offset}")
        return f"{', '.join(where)}: {self.reason}" if where else self.reason

    def located(self, *, lsn: str | None = None, source: str | None = None) -> DecodeError:
        """The same error with the outer place (capture file, LSN) filled in."""
        return DecodeError(self.reason, tag=self.tag, offset=self.offset,
                           lsn=self.lsn or lsn, source=self.source or source)


class CaptureError(CdcApplyError):
    """A capture file that cannot be read (bad JSON line, missing column)."""


class AssemblyError(CdcApplyError):
    """A message stream that breaks the protocol's order (Commit without Begin, unknown stream xid...)."""


class ConfigError(CdcApplyError):
    """A config that cannot be used; the message names the file and the key path."""
