"""date, time, timetz, timestamp, timestamptz and interval.

Values travel as Arrow storage values, which hold what Python's datetime cannot (BC dates, years
past 9999): date -> days since 1970-01-01, timestamp(tz) -> microseconds since 1970-01-01 (UTC
for timestamptz). PostgreSQL's ``infinity``/``-infinity`` become the sentinels below, which no
real value can take. Delta refuses TIME and INTERVAL columns: time and timetz travel as their
PostgreSQL text, interval as struct<months, days, microseconds> (PostgreSQL's own fields).
Text input must be in DateStyle ISO and IntervalStyle postgres (cdc_apply sets both).
"""

from __future__ import annotations

import re
import struct

from cdc_apply.lsn import PG_EPOCH_OFFSET_US
from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed, register
from cdc_apply.pgtypes.vectorized import cast_text, fixed_width

DATE_POS_INFINITY = 2**31 - 1
DATE_NEG_INFINITY = -(2**31)
TIMESTAMP_POS_INFINITY = 2**63 - 1
TIMESTAMP_NEG_INFINITY = -(2**63)
PG_EPOCH_DAYS = 10_957  # 2000-01-01 in days since 1970-01-01
US_PER_DAY = 86_400_000_000
INTERVAL_INFINITY = {"months": 2**31 - 1, "days": 2**31 - 1, "microseconds": 2**63 - 1}
INTERVAL_NEG_INFINITY = {"months": -(2**31), "days": -(2**31), "microseconds": -(2**63)}


def days_from_civil(year: int, month: int, day: int) -> int:
    """Proleptic Gregorian date (astronomical year) -> days since 1970-01-01 (H. Hinnant's algorithm)."""
    year -= month <= 2
    era = year // 400  # Python's // floors, so no negative-year correction is needed
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146_097 + doe - 719_468


def civil_from_days(days: int) -> tuple[int, int, int]:
    days += 719_468
    era = days // 146_097
    doe = days - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + (3 if mp < 10 else -9)
    return yoe + era * 400 + (month <= 2), month, day


_DATE = re.compile(r"(\d{4,})-(\d\d)-(\d\d)")
_TIME = re.compile(r"(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?")
_ZONE = re.compile(r"([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?")


def _astronomical_year(year: int, bc: bool) -> int:
    return 1 - year if bc else year


def _split_bc(text: str) -> tuple[str, bool]:
    return (text[:-3], True) if text.endswith(" BC") else (text, False)


def date_from_text(text: str, typmod: int = -1) -> int:
    if text == "infinity":
        return DATE_POS_INFINITY
    if text == "-infinity":
        return DATE_NEG_INFINITY
    body, bc = _split_bc(text)
    match = _DATE.fullmatch(body)
    if not match:
        raise ValueConversionError(f"not an ISO date: {text!r}")
    year, month, day = (int(g) for g in match.groups())
    year = _astronomical_year(year, bc)
    if not 1 <= month <= 12 or not 1 <= day <= _days_in_month(year, month):
        raise ValueConversionError(f"not a calendar date: {text!r}")
    return days_from_civil(year, month, day)


def _days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def date_from_binary(raw: bytes, typmod: int = -1) -> int:
    if len(raw) != 4:
        raise ValueConversionError(f"binary date must be 4 bytes, got {len(raw)}")
    (days,) = struct.unpack("!i", raw)
    if days in (DATE_POS_INFINITY, DATE_NEG_INFINITY):
        return days
    return days + PG_EPOCH_DAYS


def format_date(days: int) -> str:
    """PostgreSQL's ISO text of a date value."""
    if days == DATE_POS_INFINITY:
        return "infinity"
    if days == DATE_NEG_INFINITY:
        return "-infinity"
    year, month, day = civil_from_days(days)
    return f"{year:04d}-{month:02d}-{day:02d}" if year > 0 else f"{1 - year:04d}-{month:02d}-{day:02d} BC"


def _fraction_us(fraction: str | None) -> int:
    return int((fraction or "").ljust(6, "0")) if fraction else 0


def _time_of_day_us(match: re.Match[str]) -> int:
    hours, minutes, seconds = int(match[1]), int(match[2]), int(match[3])
    fraction = _fraction_us(match[4])
    # PostgreSQL prints 24:00:00 only for the time types, never for a timestamp (it rolls the day over).
    if hours > 24 or minutes > 59 or seconds > 59 or (hours == 24 and (minutes or seconds or fraction)):
        raise ValueConversionError(f"not a time of day: {match[0]!r}")
    return ((hours * 60 + minutes) * 60 + seconds) * 1_000_000 + fraction


MAX_ZONE_HOURS = 15  # PostgreSQL's limit on a UTC offset (MAX_TZDISP_HOUR)


def _zone_seconds(match: re.Match[str]) -> int:
    sign = -1 if match[1] == "-" else 1
    hours, minutes, seconds = int(match[2]), int(match[3] or 0), int(match[4] or 0)
    if hours > MAX_ZONE_HOURS or minutes > 59 or seconds > 59:
        raise ValueConversionError(f"not a UTC offset: {match[0]!r}")
    return sign * (hours * 3600 + minutes * 60 + seconds)


def _timestamp_parts(text: str, with_zone: bool) -> int:
    body, bc = _split_bc(text)
    date_text, _, rest = body.partition(" ")
    days = date_from_text(date_text + (" BC" if bc else ""))
    time_match = _TIME.match(rest)
    if not time_match or time_match[1] == "24":
        raise ValueConversionError(f"not an ISO timestamp: {text!r}")
    value = days * US_PER_DAY + _time_of_day_us(time_match)
    zone_text = rest[time_match.end():]
    if with_zone:
        zone = _ZONE.fullmatch(zone_text)
        if not zone:
            raise ValueConversionError(f"timestamptz without a numeric UTC offset: {text!r}")
        value -= _zone_seconds(zone) * 1_000_000
    elif zone_text:
        raise ValueConversionError(f"not an ISO timestamp: {text!r}")
    return value


def _infinite_timestamp(text: str) -> int | None:
    return {"infinity": TIMESTAMP_POS_INFINITY, "-infinity": TIMESTAMP_NEG_INFINITY}.get(text)


def timestamp_from_text(text: str, typmod: int = -1) -> int:
    infinite = _infinite_timestamp(text)
    return infinite if infinite is not None else _timestamp_parts(text, with_zone=False)


def timestamptz_from_text(text: str, typmod: int = -1) -> int:
    infinite = _infinite_timestamp(text)
    return infinite if infinite is not None else _timestamp_parts(text, with_zone=True)


def timestamp_from_binary(raw: bytes, typmod: int = -1) -> int:
    if len(raw) != 8:
        raise ValueConversionError(f"binary timestamp must be 8 bytes, got {len(raw)}")
    (value,) = struct.unpack("!q", raw)
    if value in (TIMESTAMP_POS_INFINITY, TIMESTAMP_NEG_INFINITY):
        return value
    return value + PG_EPOCH_OFFSET_US


def format_time_of_day(us: int) -> str:
    seconds, fraction = divmod(us, 1_000_000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{hours:02d}:{minutes:02d}:{seconds:02d}"
    return text + (f".{fraction:06d}".rstrip("0") if fraction else "")


def format_timestamp(us: int, utc_suffix: bool = False) -> str:
    """PostgreSQL's ISO text (for timestamptz, in UTC with +00)."""
    infinite = {TIMESTAMP_POS_INFINITY: "infinity", TIMESTAMP_NEG_INFINITY: "-infinity"}.get(us)
    if infinite:
        return infinite
    days, time_us = divmod(us, US_PER_DAY)
    date_text = format_date(days)
    date_part, bc = _split_bc(date_text)
    return f"{date_part} {format_time_of_day(time_us)}{'+00' if utc_suffix else ''}{' BC' if bc else ''}"


def _time_text(text: str, typmod: int) -> str:
    match = _TIME.fullmatch(text)
    if not match:
        raise ValueConversionError(f"not a time: {text!r}")
    _time_of_day_us(match)
    return text


def _time_binary(raw: bytes, typmod: int) -> str:
    if len(raw) != 8:
        raise ValueConversionError(f"binary time must be 8 bytes, got {len(raw)}")
    return format_time_of_day(struct.unpack("!q", raw)[0])


def format_zone(seconds_east: int) -> str:
    sign = "-" if seconds_east < 0 else "+"
    hours, rest = divmod(abs(seconds_east), 3600)
    minutes, seconds = divmod(rest, 60)
    text = f"{sign}{hours:02d}"
    if minutes or seconds:
        text += f":{minutes:02d}"
    if seconds:
        text += f":{seconds:02d}"
    return text


def _timetz_text(text: str, typmod: int) -> str:
    match = _TIME.match(text)
    zone = _ZONE.fullmatch(text[match.end():]) if match else None
    if not match or not zone:
        raise ValueConversionError(f"not a time with time zone: {text!r}")
    _time_of_day_us(match)
    _zone_seconds(zone)
    return text


def _timetz_binary(raw: bytes, typmod: int) -> str:
    if len(raw) != 12:
        raise ValueConversionError(f"binary timetz must be 12 bytes, got {len(raw)}")
    us, zone_west = struct.unpack("!qi", raw)
    return format_time_of_day(us) + format_zone(-zone_west)


_INTERVAL_UNIT = re.compile(r"([+-]?\d+) (year|years|mon|mons|day|days)")
_INTERVAL_TIME = re.compile(r"([+-])?(\d+):(\d\d):(\d\d)(?:\.(\d{1,6}))?")


def interval_from_text(text: str, typmod: int = -1) -> dict[str, int]:
    """IntervalStyle postgres: '1 year 2 mons -3 days +04:05:06.7', 'infinity' (PG 17+)."""
    if text == "infinity":
        return dict(INTERVAL_INFINITY)
    if text == "-infinity":
        return dict(INTERVAL_NEG_INFINITY)
    months = days = micros = 0
    for token in _tokens(text):
        unit = _INTERVAL_UNIT.fullmatch(token)
        clock = _INTERVAL_TIME.fullmatch(token)
        if unit:
            amount, name = int(unit[1]), unit[2]
            if name.startswith("year"):
                months += 12 * amount
            elif name.startswith("mon"):
                months += amount
            else:
                days += amount
        elif clock:
            value = ((int(clock[2]) * 60 + int(clock[3])) * 60 + int(clock[4])) * 1_000_000 + _fraction_us(clock[5])
            micros += -value if clock[1] == "-" else value
        else:
            raise ValueConversionError(f"not an interval in IntervalStyle postgres: {text!r}")
    return {"months": months, "days": days, "microseconds": micros}


def _tokens(text: str) -> list[str]:
    parts = text.split()
    tokens: list[str] = []
    i = 0
    while i < len(parts):
        if i + 1 < len(parts) and parts[i + 1].rstrip("s") in ("year", "mon", "day"):
            tokens.append(f"{parts[i]} {parts[i + 1]}")
            i += 2
        else:
            tokens.append(parts[i])
            i += 1
    return tokens


def interval_from_binary(raw: bytes, typmod: int = -1) -> dict[str, int]:
    if len(raw) != 16:
        raise ValueConversionError(f"binary interval must be 16 bytes, got {len(raw)}")
    micros, days, months = struct.unpack("!qii", raw)
    return {"months": months, "days": days, "microseconds": micros}


INTERVAL_SPARK_TYPE = "struct<months:int,days:int,microseconds:bigint>"

# ISO, AD, finite values only through Arrow's cast; the rest falls back to the scalar converters.
_DATE_COLUMN_BINARY = fixed_width(">i4", PG_EPOCH_DAYS, (DATE_POS_INFINITY, DATE_NEG_INFINITY))
_TIMESTAMP_COLUMN_BINARY = fixed_width(">i8", PG_EPOCH_OFFSET_US, (TIMESTAMP_POS_INFINITY, TIMESTAMP_NEG_INFINITY))
register(PgType(1082, "date", fixed("date"), date_from_text, date_from_binary, format_date, array_oid=1182,
                vector_text=cast_text, vector_binary=_DATE_COLUMN_BINARY))
register(PgType(1114, "timestamp", fixed("timestamp_ntz"), timestamp_from_text, timestamp_from_binary,
                format_timestamp, array_oid=1115, vector_text=cast_text, vector_binary=_TIMESTAMP_COLUMN_BINARY))
register(PgType(1184, "timestamptz", fixed("timestamp"), timestamptz_from_text, timestamp_from_binary,
                lambda us: format_timestamp(us, utc_suffix=True), array_oid=1185, vector_text=cast_text,
                vector_binary=_TIMESTAMP_COLUMN_BINARY))
register(PgType(1083, "time", fixed("string"), _time_text, _time_binary, array_oid=1183))
register(PgType(1266, "timetz", fixed("string"), _timetz_text, _timetz_binary, array_oid=1270))
register(PgType(1186, "interval", fixed(INTERVAL_SPARK_TYPE), interval_from_text, interval_from_binary,
                array_oid=1187))
