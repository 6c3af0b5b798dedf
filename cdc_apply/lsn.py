"""LSNs are 64-bit integers everywhere inside cdc_apply; `X/Y` is only their display form."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)
# Microseconds from the Unix epoch to the PostgreSQL epoch (2000-01-01).
PG_EPOCH_OFFSET_US = 946_684_800_000_000


def parse_lsn(text: str) -> int:
    try:
        high, low = text.split("/")
        value = (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        raise ValueError(f"not an LSN: {text!r} (expected X/Y in hex)") from None
    if value < 0 or int(high, 16) > 0xFFFFFFFF or int(low, 16) > 0xFFFFFFFF:
        raise ValueError(f"not an LSN: {text!r} (out of range)")
    return value


def format_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def pg_us_to_unix_us(pg_microseconds: int) -> int:
    return pg_microseconds + PG_EPOCH_OFFSET_US


def pg_us_to_datetime(pg_microseconds: int) -> datetime:
    """A PostgreSQL-epoch microsecond count as an aware UTC datetime."""
    return PG_EPOCH + timedelta(microseconds=pg_microseconds)


def datetime_to_pg_us(moment: datetime) -> int:
    delta = moment.astimezone(timezone.utc) - PG_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
