"""Per-peer sync slots in the site's Redis: one slow peer never holds every worker process.

A slot is a member of a sorted set per peer, scored by when it lapses. The holder
renews it while its sync runs, so a sync longer than the lease keeps its slot, and a
worker killed while holding one gives it back one lease later. Each execution holds
its own token: a task that Redis redelivers while it still runs (a sync longer than
the visibility timeout) cannot release the slot of the run it duplicates. The cap
comes from the site config (drsvc.config.SiteConfig.peer_sync_slots).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

import redis

log = logging.getLogger(__name__)

_ACQUIRE = """
redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[1])
if redis.call('zcard', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('zadd', KEYS[1], ARGV[1] + ARGV[2], ARGV[4])
  redis.call('expire', KEYS[1], math.ceil(ARGV[2]) * 2)
  return 1
end
return 0
"""


def _key(site: str, peer: str) -> str:
    return f"drsvc:{site}:peer-slots:{peer}"


class Slot:
    """One sync's claim on a slot of *peer* (acquire, then release in a finally)."""

    def __init__(self, r: redis.Redis, site: str, peer: str, *, ttl: float, label: str = ""):
        self.r, self.key, self.ttl = r, _key(site, peer), max(3.0, float(ttl))
        self.holder = f"{label}:{uuid.uuid4().hex[:12]}"
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self, cap: int) -> bool:
        """Take one of *cap* slots (cap <= 0: no cap, nothing is taken); True when held."""
        if cap <= 0:
            return True
        if not self.r.eval(_ACQUIRE, 1, self.key, time.time(), self.ttl, cap, self.holder):
            return False
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="peer-slot")
        self._renewer.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.r.zadd(self.key, {self.holder: time.time() + self.ttl}, xx=True)
            except redis.RedisError as e:      # it lapses one lease later at worst
                log.warning("could not renew the sync slot %s: %s", self.holder, e)

    def release(self) -> None:
        self._stop.set()
        if self._renewer is None:
            return
        self._renewer.join(5)
        self.r.zrem(self.key, self.holder)


def holders(r: redis.Redis, site: str, peer: str) -> list[str]:
    return [m.decode() for m in r.zrangebyscore(_key(site, peer), time.time(), "+inf")]
