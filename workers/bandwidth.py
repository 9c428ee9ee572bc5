"""The site's bandwidth caps in its Redis (``drsvc.transport.bandwidth.SiteBandwidth``).

One bucket per cap (``bwlimit`` of the site, of a peer) is shared by every sync of the
site: every worker process, every node of a multi-node site. A sync takes bytes from it
in grants of 64-256 KiB through one Lua call, and spends each grant locally in the 64 KiB
sends of its channels (``transport.LimitedChannel``): one call per grant, 50 a second
per cap up to ~100 Mbit/s and ~480 at 1 Gbit/s, whatever the number of syncs; not one per
send.

**The bucket** is a GCRA (generic cell rate algorithm) schedule: one key holds the
instant at which the bytes granted so far will all have gone at the cap, on Redis's own
clock (``TIME``), so no two hosts' clocks need agree. A grant is reserved at once and
answered with how long to wait before its bytes may go; a sync asks for its next grant
only once the last one is spent. Grants are served in the order asked, one at a time per
sync, so concurrent syncs share the cap evenly and none starves. Idle, the schedule
falls behind the clock and at most a tenth of a second of burst is let through.

**Priority.** A Demote's final sync holds a lease on each of its caps' buckets (a sorted
set, unit id -> expiry, renewed every second, lapsing 3 s after its holder stops: a killed
worker frees it). While any lease is held, the unit holding it gets the whole cap (a sync of
the same unit already running, which the Demote waits for, gets it too), and a sync of
another unit gets only what it leaves unused: a grant when the schedule has fallen behind
the clock (nothing reserved ahead), without burst, asking again when it will have (at most
0.05 s later: a priority sync that fills the cap keeps it ~0.1 s ahead). A
final sync that fills the cap leaves them nothing; one that cannot (its capture and plan
before the first byte, its unit's own ``bandwidthLimit``, a slow disk) does not idle the
link. The one grant the others may hold ahead of it is within its burst: it never waits for
them. Final syncs are bounded (what was written since the last sync), so the others wait that
long and no longer.

**Redis gone.** A sync never hangs on it and never fails for it: when a call fails (a
dead Redis fails at once; a hung one after 1 s: :func:`client`, no retries), the sync goes on
under a bucket of this process alone, at the cap divided by the processes that may sync
at once (``shares``: both workers' processes, on every node), so the site stays under its
cap if every process does the same; it asks Redis again 5 s later. A warning says so.
Priority is not kept meanwhile.

**By the hour.** A cap may be a schedule (``drsvc.rate_schedule``): each bucket reads the
rate in force at every grant, so a running sync changes speed at the boundary. The bucket's
state in Redis is an instant, not a count of bytes, so it carries across a change of rate;
an hour with no cap (rate 0) passes the sends through without a Redis call.

**No cap** (``bwlimit`` 0 or absent): no bucket, no Redis call; the sync's channels are
not even wrapped.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from drsvc.rate_schedule import RateSchedule
from drsvc.transport.bandwidth import Bandwidth, LocalBandwidth, as_schedule, combine

from .redis_client import connect

log = logging.getLogger(__name__)

GRANT_MIN, GRANT_MAX = 64 << 10, 256 << 10
POLL = 0.05             # a sync held back by another unit's priority asks again this often
LEASE_TTL = 3.0         # a priority lease lapses this long after its last renewal
REDIS_RETRY = 5.0       # after a failed call, the process's own bucket serves this long

# KEYS[1] the bucket: the instant its grants will all have gone (Redis TIME, seconds)
# KEYS[2] its priority leases: unit id -> expiry
# ARGV rate (bytes/s), burst (bytes), want (bytes), unit id, poll (s)
# -> {granted bytes, seconds to wait before they may go (none granted: before asking again)}
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) > 0 and not redis.call('ZSCORE', KEYS[2], ARGV[4]) then
  -- another unit has priority: only a cap it leaves unused, a grant at a time, no burst;
  -- ask again when the schedule will have caught up with the clock (at most after poll)
  if tat > now then
    return {0, string.format('%.6f', math.min(tonumber(ARGV[5]), math.max(0.005, tat - now)))}
  end
  burst = 0
end
if tat < now then tat = now end
local wait = tat - now - burst / rate
if wait < 0 then wait = 0 end
tat = tat + want / rate
redis.call('SET', KEYS[1], string.format('%.6f', tat), 'PX', math.ceil((tat - now) * 1000) + 60000)
return {want, string.format('%.6f', wait)}
"""

# KEYS the priority sets; ARGV unit id, ttl (s)
_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, string.format('%.6f', now + tonumber(ARGV[2])), ARGV[1])
  redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[2]) * 2000))
end
return 1
"""


def client(url: str) -> redis.Redis:
    """A client for the caps: one try, answered within 1 s or not at all (redis-py's default
    retries ten times with backoff: ~4.5 s on a dead Redis, ~15 s on a hung one), so a sync
    falls back to its process's share at once instead of stalling."""
    return connect(url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))


def grant_size(rate: float) -> int:
    """A fiftieth of a second at the cap, within 64-256 KiB: few calls at a high cap, and a
    grant never holds a low cap's link for long."""
    return int(min(GRANT_MAX, max(GRANT_MIN, rate / 50)))


class RedisBucket:
    """One sync's share of one shared cap (``drsvc.transport.bandwidth.Bandwidth``): what
    is left of its last grant, and the grants it asks the site's bucket for."""

    def __init__(self, r: redis.Redis, key: str, rate: float | RateSchedule, *, unit_id: str, fallback: Bandwidth,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time):
        self.r, self.key, self.unit_id = r, key, unit_id
        self.schedule = as_schedule(rate)
        self.priority_key = f"{key}:priority"
        self.rate, self.grant, self.burst, self.credit = 0.0, 0, 0.0, 0
        self._wall = wall
        self._follow_schedule()
        self.fallback = fallback
        self._script = r.register_script(_TAKE)
        self._clock, self._sleep = clock, sleep
        self._local_until = 0.0
        self._lock = threading.Lock()     # the stripes of one sync take in turn

    def _follow_schedule(self) -> float:
        """The rate in force now; a change resizes the grants, and takes effect with the next
        one (the bucket's schedule in Redis is in seconds, so it carries across)."""
        rate = float(self.schedule.rate_at(self._wall()))
        if rate != self.rate:
            self.rate = rate
            self.grant = grant_size(rate) if rate else 0
            self.burst = max(self.grant, rate / 10)
            self.credit = min(self.credit, self.grant)
        return rate

    def take(self, nbytes: int) -> None:
        with self._lock:
            if not self._follow_schedule():
                return                    # no cap at this hour
            while self.credit < nbytes:
                self.credit += self._ask(max(self.grant, nbytes - self.credit))
            self.credit -= nbytes

    def _ask(self, want: int) -> int:
        """Bytes granted (0: another unit has priority), after waiting until they may go."""
        if self._clock() < self._local_until:
            self.fallback.take(want)
            return want
        try:
            got, wait = self._script(keys=[self.key, self.priority_key],
                                     args=[self.rate, self.burst, want, self.unit_id, POLL])
        except redis.RedisError as e:
            if not self._local_until:
                log.warning("bandwidth cap %s: the site's Redis does not answer (%s); this sync of %s goes on "
                            "at this process's share, %.0f bytes/s, and asks again every %.0fs",
                            self.key, type(e).__name__, self.unit_id, self.fallback.rate, REDIS_RETRY)
            self._local_until = self._clock() + REDIS_RETRY
            self.fallback.take(want)
            return want
        if self._local_until:
            log.warning("bandwidth cap %s: the site's Redis answers again; %s is back on the shared cap",
                        self.key, self.unit_id)
            self._local_until = 0.0
        if float(wait) > 0:
            self._sleep(float(wait))
        return int(got)


class PriorityLease(AbstractContextManager):
    """While held, *unit_id*'s syncs go ahead of every other sync under the same caps:
    a member of each cap's priority set, renewed every LEASE_TTL / 3 by a thread, removed
    on exit (or lapsing LEASE_TTL after a killed holder's last renewal). A Redis that does
    not answer costs the priority, never the sync."""

    def __init__(self, r: redis.Redis, keys: list[str], unit_id: str, *, ttl: float = LEASE_TTL):
        self.r, self.keys, self.unit_id, self.ttl = r, list(keys), unit_id, ttl
        self._script = r.register_script(_LEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def __enter__(self):
        self._renew()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"bw-priority-{self.unit_id}")
        self._thread.start()
        return self

    def _renew(self) -> None:
        try:
            self._script(keys=self.keys, args=[self.unit_id, self.ttl])
        except redis.RedisError as e:
            if not self._failing:
                log.warning("bandwidth priority of %s: the site's Redis does not answer (%s); its sync "
                            "shares the cap until it does", self.unit_id, type(e).__name__)
            self._failing = True
            return
        self._failing = False

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self._renew()

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            for key in self.keys:
                self.r.zrem(key, self.unit_id)
        except redis.RedisError as e:      # it lapses LEASE_TTL later
            log.warning("could not drop the bandwidth priority of %s (%s); it lapses in %.0fs",
                        self.unit_id, type(e).__name__, self.ttl)
        return False


class RedisBandwidth:
    """The site's caps (``SiteConfig.bandwidth_caps``) as buckets in its Redis, keys
    ``drsvc:<site>:bw:site`` and ``drsvc:<site>:bw:peer:<peer>`` (+ ``:priority``).
    *shares*: how many processes of the site may sync at once; while Redis is away each
    takes cap / shares through a bucket of its own (one per cap, for every sync of the
    process)."""

    def __init__(self, r: redis.Redis, site: str, caps: Callable[[str], dict[str, int | RateSchedule]], *,
                 shares: int):
        self.r, self.caps, self.shares = r, caps, max(1, int(shares))
        self.prefix = f"drsvc:{site}:bw:"
        self.local = LocalBandwidth(caps)

    def limiter(self, unit_id: str, peer: str) -> Bandwidth | None:
        return combine(*(RedisBucket(self.r, self.prefix + name, cap, unit_id=unit_id,
                                     fallback=self.local.bucket(name, cap, share=self.shares))
                         for name, cap in self.caps(peer).items()))

    def priority(self, unit_id: str, peer: str) -> AbstractContextManager:
        keys = [f"{self.prefix}{name}:priority" for name in self.caps(peer)]
        return PriorityLease(self.r, keys, unit_id) if keys else nullcontext()
