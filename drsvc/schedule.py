"""Replication schedules: interval parsing and health against the interval (pure)."""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from datetime import datetime, time as dtime, UTC

from .errors import InvalidParameter

_PART = re.compile(r"(\d+)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MIN_INTERVAL = 1
MAX_INTERVAL = 7 * 86400


def parse_interval(text: str, key: str = "schedulingInterval", maximum: int = MAX_INTERVAL) -> int:
    """'30s', '5m', '1h', '1h30m', or a bare number of seconds -> seconds."""
    text = (text or "").strip()
    if text.isascii() and text.isdigit():
        secs = int(text)
    else:
        parts = _PART.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise InvalidParameter(key=key, reason=f"{text!r} is not like 30s, 5m, 1h or 1h30m")
        secs = sum(int(n) * _UNITS[u] for n, u in parts)
    if not MIN_INTERVAL <= secs <= maximum:
        raise InvalidParameter(key=key, reason=f"must be between {MIN_INTERVAL}s and {maximum // 86400}d")
    return secs


MAX_VERIFY_INTERVAL = 90 * 86400
DEFAULT_VERIFY_INTERVAL = 7 * 86400


def parse_verify_interval(text: str, key: str = "drsvc.io/verifyInterval") -> int:
    """A verify (scrub) interval: like a sync interval, up to 90d; "0" or "off": none."""
    text = (text or "").strip()
    if text in ("0", "off"):
        return 0
    return parse_interval(text, key, MAX_VERIFY_INTERVAL)


def parse_start_time(text: str) -> float | None:
    """An ISO 8601 timestamp or a time of day (HH:MM[:SS], UTC) -> epoch seconds."""
    if not text:
        return None
    try:
        if "T" in text or "-" in text[:10]:
            dt = datetime.fromisoformat(text)
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=UTC)
            return dt.timestamp()
        t = dtime.fromisoformat(text)
    except ValueError:
        raise InvalidParameter(key="schedulingStartTime",
                               reason=f"{text!r} is neither ISO 8601 nor HH:MM[:SS]") from None
    today = datetime.now(UTC).date()
    return datetime.combine(today, t.replace(tzinfo=t.tzinfo or UTC)).timestamp()


def phase(unit_id: str, interval: int, start_time: float | None = None) -> float:
    """Where in each interval a unit's syncs fall, in seconds after the epoch's slot.

    A schedulingStartTime sets it. Otherwise it comes from a hash of the unit id, so N
    units with one interval spread evenly over it instead of firing at once, and every
    scheduler (a new leader too) computes the same slots: no burst and no gap."""
    if start_time is not None:
        return start_time % interval
    h = int.from_bytes(hashlib.sha256(unit_id.encode()).digest()[:8], "big")
    return (h % (interval * 1000)) / 1000.0


def slot_at_or_before(now: float, interval: int, ph: float) -> float:
    """The latest slot (phase + k*interval) not after *now*: when a sync was due."""
    return ph + math.floor((now - ph) / interval) * interval


def catch_up(missed: list[tuple[str, float, int]], now: float) -> dict[str, float]:
    """New run times for runs a scheduler missed (while no leader was up), given as
    (job, when it was due, its interval): replayed in the order they were due and at the
    pace they were due, from *now*, so a takeover brings neither a burst (every late unit
    at once) nor a gap (skipping them to their next slot). A longer outage is compressed
    into the shortest interval among them, so no unit waits more than one of those."""
    if not missed:
        return {}
    first = min(due for _, due, _ in missed)
    span = max(due for _, due, _ in missed) - first
    window = min(span, min(interval for _, _, interval in missed))
    scale = window / span if span > 0 else 0.0
    return {job: now + (due - first) * scale for job, due, _ in sorted(missed, key=lambda m: (m[1], m[0]))}


@dataclass(frozen=True)
class Health:
    status: str          # HEALTHY | DEGRADED | ERROR | UNKNOWN
    message: str
    lag_seconds: float
    missed_intervals: int


def assess(*, now: float, interval: int, enabled_at: float, last_success: float,
           consecutive_failures: int, last_error: str, conflict: str = "") -> Health:
    """Health of a primary's replication relative to its interval."""
    # a re-promoted primary counts from its promotion, not from its previous term
    pending = last_success < enabled_at
    since = max(last_success, enabled_at)
    lag = max(0.0, now - since)
    missed = max(0, int(lag // interval) - 1) if interval else 0
    if conflict:
        return Health("ERROR", conflict, lag, missed)
    if consecutive_failures:
        return Health("DEGRADED", f"{consecutive_failures} consecutive sync failure(s); last: {last_error}",
                      lag, missed)
    if lag > 2 * interval + 5:
        what = "replication was enabled or promoted" if pending else "last successful sync"
        return Health("DEGRADED", f"behind schedule: {what} {lag:.0f}s ago, interval {interval}s", lag, missed)
    if pending:
        return Health("UNKNOWN", "initial sync pending", lag, missed)
    return Health("HEALTHY", f"in sync; last sync {lag:.0f}s ago", lag, missed)
