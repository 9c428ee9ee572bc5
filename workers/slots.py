"""Per-peer sync slots in the site's Redis: one slow peer never holds every worker process.

A slot is a member of a sorted set per peer, scored by when it lapses, so a worker
killed while holding one gives it back after the visibility timeout. The cap comes
from the site config (drsvc.config.SiteConfig.peer_sync_slots).
"""
from __future__ import annotations

import time

import redis

_ACQUIRE = """
redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[1])
if redis.call('zscore', KEYS[1], ARGV[4]) then
  redis.call('zadd', KEYS[1], ARGV[1] + ARGV[2], ARGV[4])
  return 1
end
if redis.call('zcard', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('zadd', KEYS[1], ARGV[1] + ARGV[2], ARGV[4])
  redis.call('expire', KEYS[1], math.ceil(ARGV[2]))
  return 1
end
return 0
"""


def _key(site: str, peer: str) -> str:
    return f"drsvc:{site}:peer-slots:{peer}"


def acquire(r: redis.Redis, site: str, peer: str, holder: str, *, cap: int, ttl: float) -> bool:
    """Take one of *cap* slots of *peer* for *holder* (a task id); True when taken."""
    if cap <= 0:
        return True
    return bool(r.eval(_ACQUIRE, 1, _key(site, peer), time.time(), ttl, cap, holder))


def release(r: redis.Redis, site: str, peer: str, holder: str) -> None:
    r.zrem(_key(site, peer), holder)


def holders(r: redis.Redis, site: str, peer: str) -> list[str]:
    return [m.decode() for m in r.zrangebyscore(_key(site, peer), time.time(), "+inf")]
