"""A bandwidth cap that follows the clock: ``bwlimit = "100mbit 08:00-20:00 Mon-Fri, 1gbit"``.

A schedule is a list of entries separated by commas. Each entry is a rate, then when it
applies: a time window ``HH:MM-HH:MM`` (seconds may be given: ``HH:MM:SS``), days (``Mon``,
``Mon-Fri``, ``Sat-Sun``; several may be listed, space-separated), or both. The last entry is
the default, and names a rate only. The first entry that matches the moment wins, so a
narrower window goes before a wider one. A window whose end is before its start runs past
midnight, and its days are the days it starts on; ``24:00`` ends a window at midnight. The
rate ``0`` means no cap. Times are read in the site's ``timezone`` (default UTC), so a window
keeps its wall-clock hours across daylight-saving changes.

A plain rate (``"200mbit"`` or an integer) is a schedule of one entry, the default.

DR links are shared with business traffic by the hour: a tight cap in office hours and the
whole link at night is what operators set by hand otherwise. The buckets that enforce a cap
ask :meth:`RateSchedule.rate_at` at each grant, so a sync that is running when the hour
turns changes speed at the boundary, not at its next start.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_SECONDS = 86400
_UNIT = re.compile(r"[A-Za-z/]+")
_TIME = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?")


class ScheduleInvalid(ValueError):
    """An entry of a schedule that cannot be read; the message names the entry and why."""


@dataclass(frozen=True)
class Window:
    """One entry before the default: *rate* from *start* to *end* (seconds after local
    midnight; an end at or before the start runs past midnight) on *days* (0 Monday)."""
    rate: int
    days: frozenset
    start: int
    end: int
    text: str

    def covers(self, weekday: int, second: int) -> bool:
        if self.start < self.end:
            return weekday in self.days and self.start <= second < self.end
        # past midnight: the evening part on a listed day, the morning part the day after one
        return (weekday in self.days and second >= self.start) or \
            ((weekday - 1) % 7 in self.days and second < self.end)


@dataclass(frozen=True)
class RateSchedule:
    windows: tuple
    default: int
    tz: tzinfo = UTC
    text: str = ""

    @classmethod
    def constant(cls, rate: int) -> RateSchedule:
        return cls(windows=(), default=int(rate), text=str(rate))

    @property
    def is_constant(self) -> bool:
        return not self.windows

    @property
    def ever_capped(self) -> bool:
        """Whether any entry caps anything (a schedule of zeros needs no bucket)."""
        return bool(self.default) or any(w.rate for w in self.windows)

    def entry_at(self, t: float) -> Window | None:
        """The window in force at *t* (epoch seconds), or None for the default."""
        if not self.windows:
            return None
        local = datetime.fromtimestamp(t, self.tz)
        second = local.hour * 3600 + local.minute * 60 + local.second
        weekday = local.weekday()
        for w in self.windows:
            if w.covers(weekday, second):
                return w
        return None

    def rate_at(self, t: float) -> int:
        """Bytes per second allowed at *t* (0: no cap)."""
        w = self.entry_at(t)
        return self.default if w is None else w.rate

    def next_change(self, t: float) -> tuple[float, int] | None:
        """(when, rate): the first instant after *t* at which the rate differs from now, within
        the coming eight days (a weekly schedule repeats), or None when it never changes."""
        if not self.windows:
            return None
        now = self.rate_at(t)
        for edge in self._edges_after(t):
            rate = self.rate_at(edge)
            if rate != now:
                return edge, rate
        return None

    def _edges_after(self, t: float) -> list[float]:
        day0 = datetime.fromtimestamp(t, self.tz).replace(hour=0, minute=0, second=0, microsecond=0)
        edges = set()
        for offset in range(-1, 9):
            day = (day0 + timedelta(days=offset)).replace(tzinfo=None)
            for w in self.windows:
                for second in (w.start, w.end):
                    local = day + timedelta(seconds=second)
                    edges.add(local.replace(tzinfo=self.tz).timestamp())
        return sorted(e for e in edges if e > t)

    def describe(self, t: float) -> dict:
        """What is in force at *t* and what comes next, for operators (``drsvc site status``)."""
        w = self.entry_at(t)
        out = {"rate": self.rate_at(t), "entry": w.text if w else "default", "schedule": self.text}
        nxt = self.next_change(t)
        if nxt is not None:
            out["next_change"] = datetime.fromtimestamp(nxt[0], self.tz).isoformat(timespec="seconds")
            out["next_rate"] = nxt[1]
        return out


def zone(name: str) -> tzinfo:
    """The time zone a schedule is read in: an IANA name ("Europe/Berlin") or "UTC"."""
    if name.upper() == "UTC":
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise ScheduleInvalid(f"timezone {name!r} is not a known IANA time zone (e.g. \"Europe/Berlin\", "
                              f"\"UTC\"): {e}") from None


def is_schedule(text: str) -> bool:
    """Whether *text* is more than a plain rate: entries, a time window or days."""
    words = text.replace(",", " ").split()
    return "," in text or ":" in text or any(all(_day_name(p) for p in w.lower().split("-")) for w in words)


def parse_schedule(text: str, rate_of, tz: tzinfo = UTC) -> RateSchedule:
    """*text* -> a RateSchedule; *rate_of* turns one rate's text into bytes per second (and
    raises for a bad one). Raises ScheduleInvalid naming the entry at fault."""
    entries = [e.strip() for e in text.split(",")]
    if any(not e for e in entries):
        raise ScheduleInvalid(f"{text!r} has an empty entry (two commas, or one at an end)")
    windows = []
    for i, entry in enumerate(entries):
        rate_text, when = _split_rate(entry.split())
        rate = rate_of(rate_text)
        last = i == len(entries) - 1
        if last and when:
            raise ScheduleInvalid(f"the last entry {entry!r} is the default and takes no time or days: "
                                  f"add a default rate after it, e.g. {text!r} + \", 1gbit\"")
        if not last and not when:
            raise ScheduleInvalid(f"entry {entry!r} names no time window or days: only the last entry "
                                  f"may be a bare rate (the default)")
        if not last:
            windows.append(_window(rate, when, entry))
    return RateSchedule(windows=tuple(windows), default=rate_of(_split_rate(entries[-1].split())[0]), tz=tz,
                        text=text)


def _split_rate(words: list[str]) -> tuple[str, list[str]]:
    """An entry's rate and what follows it; the rate's unit may stand apart ("12.5 MiB/s")."""
    if len(words) > 1 and _UNIT.fullmatch(words[1]) and not _day_name(words[1].lower()):
        return words[0] + words[1], words[2:]
    return words[0], words[1:]


def _window(rate: int, words: list[str], entry: str) -> Window:
    start, end, days = 0, DAY_SECONDS, set()
    times = [w for w in words if ":" in w]
    if len(times) > 1:
        raise ScheduleInvalid(f"entry {entry!r} has {len(times)} time windows; give one per entry")
    if times:
        start, end = _span(times[0], entry)
    for w in (w for w in words if ":" not in w):
        days |= _days(w, entry)
    return Window(rate=rate, days=frozenset(days or range(7)), start=start, end=end, text=entry)


def _span(text: str, entry: str) -> tuple[int, int]:
    parts = text.split("-")
    if len(parts) != 2:
        raise ScheduleInvalid(f"entry {entry!r}: {text!r} is not a window HH:MM-HH:MM")
    start, end = (_seconds(p, entry) for p in parts)
    if start == DAY_SECONDS:
        raise ScheduleInvalid(f"entry {entry!r}: a window starts before 24:00")
    if start == end:
        raise ScheduleInvalid(f"entry {entry!r}: window {text!r} is empty (its start is its end); "
                              f"a whole day is 00:00-24:00, or days alone")
    return start, end


def _seconds(text: str, entry: str) -> int:
    m = _TIME.fullmatch(text)
    if m is None:
        raise ScheduleInvalid(f"entry {entry!r}: {text!r} is not a time HH:MM or HH:MM:SS")
    h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if (h, mi, s) == (24, 0, 0):
        return DAY_SECONDS
    if h > 23 or mi > 59 or s > 59:
        raise ScheduleInvalid(f"entry {entry!r}: {text!r} is not a time of day (00:00 to 24:00)")
    return h * 3600 + mi * 60 + s


def _days(text: str, entry: str) -> set[int]:
    parts = text.lower().split("-")
    if len(parts) > 2 or not all(_day_name(p) for p in parts):
        raise ScheduleInvalid(f"entry {entry!r}: {text!r} is neither a time window nor days "
                              f"(Mon, Mon-Fri, Sat-Sun: {', '.join(d.title() for d in DAYS)})")
    first, last = (DAYS.index(p[:3]) for p in (parts[0], parts[-1]))
    return {(first + k) % 7 for k in range((last - first) % 7 + 1)}


_FULL = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _day_name(word: str) -> bool:
    """Mon or Monday (any case), not a prefix of something else."""
    return any(word == d[:3] or word == full for d, full in zip(DAYS, _FULL, strict=True))
