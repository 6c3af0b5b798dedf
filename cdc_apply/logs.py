"""Logging for the CLI and jobs: text or one JSON object per line, and never a password.

Every record passes ``redact``: ``password=...`` in connection strings, ``user:secret@`` in URLs
and ``PGPASSWORD=...`` are replaced by ``***`` before any handler sees them.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timezone

_SECRETS = [
    # An unquoted value ends at white space or a quote, so a redacted value inside quotes keeps them.
    (re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s'\"]+)", re.IGNORECASE), r"\1***"),
    (re.compile(r"(PGPASSWORD\s*=\s*)([^\s'\"]+)"), r"\1***"),
    (re.compile(r"(://[^:/@\s]+:)([^@\s]+)(@)"), r"\1***\3"),
]


def redact(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


def configure(verbose: bool = False, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RedactingFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("py4j").setLevel(logging.WARNING)
