"""W3C Datetime (https://www.w3.org/TR/NOTE-datetime), the time format of every ResourceSync attribute (§7).

Values are normalised to timezone-aware UTC datetimes. An offset is *subtracted* to reach UTC
(``09:00+01:00`` is ``08:00Z``); the resync client gets this sign wrong, we do not.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

_W3C = re.compile(
    r"(?P<y>\d{4})(?:-(?P<mo>\d{2})(?:-(?P<d>\d{2})"
    r"(?:T(?P<h>\d{2}):(?P<mi>\d{2})(?::(?P<s>\d{2})(?:\.(?P<f>\d+))?)?"
    r"(?P<tz>Z|[+-]\d{2}:\d{2})?)?)?)?\Z"
)


class DatetimeError(ValueError):
    """A value that is not a W3C Datetime."""


def parse_w3c(value: str) -> datetime:
    """Parse any W3C Datetime granularity into an aware UTC datetime.

    A time without a zone designator is not W3C Datetime; it is read as UTC (lenient), and
    ``is_strict_w3c`` lets the validator report it.
    """
    text = value.strip()
    # Fast path for the recommended form YYYY-MM-DDThh:mm:ssZ (§7): no regex, no fromisoformat.
    if len(text) == 20 and text[19] == "Z" and text[10] == "T":
        try:
            return datetime(
                int(text[0:4]), int(text[5:7]), int(text[8:10]),
                int(text[11:13]), int(text[14:16]), int(text[17:19]), tzinfo=UTC,
            )  # fmt: skip
        except ValueError:
            pass
    m = _W3C.match(text)
    if m is None:
        raise DatetimeError(f"not a W3C Datetime: {value!r}")
    g = m.groupdict()
    try:
        frac = g["f"] or "0"
        dt = datetime(
            int(g["y"]), int(g["mo"] or 1), int(g["d"] or 1),
            int(g["h"] or 0), int(g["mi"] or 0), int(g["s"] or 0),
            int((frac + "000000")[:6]), tzinfo=UTC,
        )  # fmt: skip
    except ValueError as exc:
        raise DatetimeError(f"not a W3C Datetime: {value!r} ({exc})") from None
    tz = g["tz"]
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        offset = timedelta(hours=int(tz[1:3]), minutes=int(tz[4:6]))
        dt = dt.replace(tzinfo=timezone(sign * offset)).astimezone(UTC)
    return dt


def is_strict_w3c(value: str) -> bool:
    """True when the value is W3C Datetime to the letter (a time part needs a zone designator)."""
    m = _W3C.match(value.strip())
    return m is not None and not (m.group("h") and not m.group("tz"))


def format_w3c(dt: datetime) -> str:
    """Write a datetime as ``YYYY-MM-DDThh:mm:ss[.ffffff]Z``, the form §7 recommends."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    else:
        dt = dt.astimezone(UTC)
    s = f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}T{dt.hour:02d}:{dt.minute:02d}:{dt.second:02d}"
    if dt.microsecond:  # (not strftime: its %Y does not pad years before 1000 to four digits)
        s += f".{dt.microsecond:06d}".rstrip("0")
    return s + "Z"


def utcnow() -> datetime:
    """The current time, aware, in UTC: every time rsagg writes is its own clock in UTC."""
    return datetime.now(UTC)
