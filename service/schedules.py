"""When a schedule fires: cron expressions and fixed intervals, in a time zone.

Pure computation (no database, no queue). Times handed in and out are naive UTC datetimes, as
stored in the database; a cron expression is read in the schedule's time zone ("0 3 * * *" in
Europe/Paris is 03:00 Paris time, whatever the offset that day).

Missed fires: ``due_fire`` returns only the latest scheduled time not after ``now``, so a
schedule whose beat was down for ten periods fires once when beat comes back, not ten times.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from headatlas.service.errors import ParameterError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_EVERY_S = 366 * 86400  # longer periods are a cron expression's job ("0 3 1 1 *": yearly)
EVERY_RE = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")


def parse_every(text: str) -> int:
    """'6h' / '30m' / '45s' / '2d' → seconds."""
    match = EVERY_RE.match(text or "")
    if not match or int(match.group(1)) <= 0:
        raise ParameterError(
            f"--every {text!r} is not an interval: write a positive number and a unit, e.g. 45s, 30m, 6h or 1d"
        )
    seconds = int(match.group(1)) * UNITS[match.group(2)]
    if seconds > MAX_EVERY_S:
        raise ParameterError(
            f"--every {text!r} is longer than a year (366d): use --cron for rare fires, "
            'e.g. "0 3 1 1 *" (every 1 January at 03:00)'
        )
    return seconds


def format_every(seconds: int) -> str:
    for unit in ("d", "h", "m"):
        if seconds % UNITS[unit] == 0:
            return f"{seconds // UNITS[unit]}{unit}"
    return f"{seconds}s"


def check_cron(expression: str) -> str:
    from croniter import CroniterBadDateError, croniter

    expression = " ".join((expression or "").split())
    if len(expression.split()) != 5 or not croniter.is_valid(expression):
        raise ParameterError(
            f"--cron {expression!r} is not a cron expression: give five fields, minute hour day-of-month month "
            'day-of-week, e.g. "0 3 * * *" (daily at 03:00) or "*/15 * * * *" (every 15 minutes)'
        )
    try:  # valid fields can still name no date ("0 3 31 2 *": 31 February)
        croniter(expression, datetime(2000, 1, 1)).get_next(datetime)
    except (CroniterBadDateError, ValueError, OverflowError):
        raise ParameterError(
            f"--cron {expression!r} never fires (no date matches its day-of-month and month): "
            'check those fields, e.g. "0 3 28 2 *" for 28 February'
        ) from None
    return expression


def check_timezone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ParameterError(
            f"--timezone {name!r} is not a known time zone: use an IANA name such as UTC or Europe/Paris"
        ) from None


@dataclass(frozen=True)
class Cadence:
    """A cron expression or an interval (seconds from ``anchor``), in a time zone."""

    cron: str | None
    every_s: int | None
    timezone: str = "UTC"
    anchor: datetime | None = None  # naive UTC; interval fires are anchor + k * every_s

    def __post_init__(self):
        if (self.cron is None) == (self.every_s is None):
            raise ParameterError("give exactly one of --cron EXPR or --every INTERVAL")
        if self.cron is not None:
            check_cron(self.cron)
        check_timezone(self.timezone)

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        assert self.every_s is not None  # __post_init__: exactly one of cron and every_s
        return f"every {format_every(self.every_s)}"

    def next_after(self, t: datetime) -> datetime:
        """The first scheduled time strictly after ``t`` (naive UTC)."""
        if self.every_s is not None:
            k = _floor_div(t - self._anchor(), self.every_s) + 1
            return self._anchor() + timedelta(seconds=k * self.every_s)
        from croniter import croniter

        local = _to_local(t, self.timezone)
        return _to_utc(croniter(self.cron, local).get_next(datetime))

    def latest_at_or_before(self, t: datetime) -> datetime:
        """The last scheduled time not after ``t`` (naive UTC)."""
        if self.every_s is not None:
            k = _floor_div(t - self._anchor(), self.every_s)
            return self._anchor() + timedelta(seconds=k * self.every_s)
        from croniter import croniter

        local = _to_local(t + timedelta(microseconds=1), self.timezone)  # get_prev is strict
        return _to_utc(croniter(self.cron, local).get_prev(datetime))

    def _anchor(self) -> datetime:
        return self.anchor or datetime(2000, 1, 1)


def due_fire(cadence: Cadence, next_fire: datetime, now: datetime) -> datetime | None:
    """The fire time to run now, or None. When several scheduled times have passed (beat was
    down), only the latest of them fires: one run, not one per missed tick."""
    if now < next_fire:
        return None
    return max(next_fire, cadence.latest_at_or_before(now))


def _floor_div(delta: timedelta, seconds: int) -> int:
    micro = delta // timedelta(microseconds=1)
    return micro // (seconds * 1_000_000)


def _to_local(t: datetime, tz: str) -> datetime:
    return t.replace(tzinfo=timezone.utc).astimezone(ZoneInfo(tz))


def _to_utc(t: datetime) -> datetime:
    return t.astimezone(timezone.utc).replace(tzinfo=None, microsecond=0)
