"""Bandwidth limits on what a sync sends: one interface, a local bucket, a composite.

A sync's session holds ONE :class:`Bandwidth` (``replication.driver.Job.bandwidth``),
built by the caller of ``sync_unit``. Every channel the session sends on (one, or one
per stripe) is a ``transport.LimitedChannel`` around that one object, called from as
many threads, so every implementation is thread-safe.

The limits a sync is under (its unit's ``bandwidthLimit``, a peer's ``bwlimit``, the
site's ``bwlimit``) are applied one after the other by :class:`AllOf`, so the tightest
sets the rate. A limit shared by several processes or nodes lives at the edge
(``workers.bandwidth``: a bucket in the site's Redis); the worker's jobs ask for it
through :class:`SiteBandwidth`. :class:`LocalBandwidth` is the same interface for a
site whose syncs all run in one process (no Redis to share a bucket through).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from ..rate_schedule import RateSchedule


class Bandwidth(Protocol):
    def take(self, nbytes: int) -> None:
        """Block until *nbytes* more may be sent."""


class TokenBucket:
    """A limit in bytes per second for the takers of one process, with a burst of a tenth
    of a second (at least one 64 KiB send), so a limited link is never flooded for long.

    First come, first served: a take reserves its bytes at once (the bucket may go into
    debt) and sleeps, outside the lock, until the debt is paid. Threads calling take share
    the rate in the order they asked; none starves, and the long-run rate is exact."""

    def __init__(self, rate: float, burst: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if rate <= 0:
            raise ValueError(f"a bucket's rate must be positive, not {rate!r}")
        self.rate = float(rate)
        self.capacity = float(burst if burst is not None else max(64 << 10, rate / 10))
        self.tokens = self.capacity
        self._clock, self._sleep = clock, sleep
        self.stamp = clock()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Take *nbytes* now; returns the seconds to wait before they may go."""
        with self._lock:
            now = self._clock()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= nbytes
            return max(0.0, -self.tokens / self.rate)

    def take(self, nbytes: int) -> None:
        wait = self.reserve(nbytes)
        if wait > 0:
            self._sleep(wait)


class AllOf:
    """Several limits on one stream: the bytes wait for each in turn, so the tightest sets
    the rate (the others have refilled while it made the bytes wait). Give the limits of
    this sync alone first and shared ones last: a shared bucket's grant is then used as
    soon as it is given, never held back by another limit's wait."""

    def __init__(self, limits):
        self.limits = tuple(limits)

    def take(self, nbytes: int) -> None:
        for limit in self.limits:
            limit.take(nbytes)


def combine(*limits: Bandwidth | None) -> Bandwidth | None:
    """The limits given (None ones left out), applied in order; None when there is none."""
    present = [limit for limit in limits if limit is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else AllOf(present)


class SiteBandwidth(Protocol):
    """The site's caps (``bwlimit``, site-wide and per peer) as the worker's jobs use them."""

    def limiter(self, unit_id: str, peer: str) -> Bandwidth | None:
        """The site's shared limits on one sync of *unit_id* to *peer*: None when no cap is
        set (then a sync costs nothing here)."""

    def priority(self, unit_id: str, peer: str) -> AbstractContextManager:
        """Held while *unit_id*'s syncs must go ahead of every other sync under the same
        caps (a Demote's final sync): meanwhile the others get no bandwidth."""


def as_schedule(cap: int | RateSchedule) -> RateSchedule:
    """A cap as the buckets take it: a plain rate is a schedule of one entry."""
    return cap if isinstance(cap, RateSchedule) else RateSchedule.constant(int(cap))


class ScheduledBucket:
    """A :class:`TokenBucket` whose rate follows a schedule (``bwlimit`` by the hour),
    divided by *share*: at each take it reads the rate in force, and when that changed it
    starts a bucket at the new rate, so a running sync changes speed at the boundary. A
    rate of 0 (no cap at this hour) lets everything through."""

    def __init__(self, schedule: RateSchedule, share: int = 1, *, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.schedule, self.share = schedule, max(1, int(share))
        self._wall, self._clock, self._sleep = wall, clock, sleep
        self._bucket: TokenBucket | None = None
        self._lock = threading.Lock()

    @property
    def rate(self) -> float:
        """Bytes per second allowed now (0: no cap)."""
        r = self.schedule.rate_at(self._wall())
        return max(1, r // self.share) if r else 0

    def _current(self) -> TokenBucket | None:
        rate = self.rate
        with self._lock:
            if not rate:
                self._bucket = None
            elif self._bucket is None or self._bucket.rate != rate:
                self._bucket = TokenBucket(rate, clock=self._clock, sleep=self._sleep)
            return self._bucket

    def take(self, nbytes: int) -> None:
        bucket = self._current()
        if bucket is not None:
            bucket.take(nbytes)


class LocalBandwidth:
    """:class:`SiteBandwidth` for syncs that all run in this process: one bucket per cap,
    shared by every sync of the process. Priority needs the shared implementation
    (``workers.bandwidth``); here it is not kept. *caps* gives a peer's caps, name -> a
    rate or a :class:`RateSchedule` (``SiteConfig.cap_schedules``)."""

    def __init__(self, caps: Callable[[str], dict[str, int | RateSchedule]]):
        self.caps = caps
        self._buckets: dict[tuple[str, str, int], ScheduledBucket] = {}
        self._lock = threading.Lock()

    def bucket(self, name: str, cap: int | RateSchedule, share: int = 1) -> ScheduledBucket:
        """The process's bucket for cap *name* (the same object every time), at its rate
        divided by *share*."""
        schedule = as_schedule(cap)
        key = (name, schedule.text, share)
        with self._lock:
            if key not in self._buckets:
                self._buckets[key] = ScheduledBucket(schedule, share)
            return self._buckets[key]

    def limiter(self, unit_id: str, peer: str) -> Bandwidth | None:
        return combine(*(self.bucket(name, cap) for name, cap in self.caps(peer).items()))

    def priority(self, unit_id: str, peer: str) -> AbstractContextManager:
        return nullcontext()


def rate_of(limit: Bandwidth | None) -> float | None:
    """The tightest rate a limit is known to hold (bytes/s), or None: a hint for sizing a
    sync's stripes when the path's own rate is not configured."""
    if limit is None:
        return None
    if isinstance(limit, AllOf):
        rates = [r for r in (rate_of(x) for x in limit.limits) if r]
        return min(rates) if rates else None
    rate = getattr(limit, "rate", None)
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None
