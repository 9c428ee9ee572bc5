"""The per-unit in-flight marker in the site's Redis.

One operation per unit at a time: an identical request joins the task in
flight; a different one is refused (ABORTED at the gRPC edge).
"""
from __future__ import annotations

import hashlib
import json

import redis

TTL = 6 * 3600


def _key(site: str, unit_id: str) -> str:
    return f"drsvc:{site}:inflight:{unit_id}"


def digest(op: str, kwargs: dict) -> str:
    return hashlib.sha256(json.dumps([op, kwargs], sort_keys=True).encode()).hexdigest()[:16]


def claim(r: redis.Redis, site: str, unit_id: str, op: str, kwargs: dict, task_id: str) -> dict:
    """Claim the unit for *task_id*, or return the claim already held."""
    mine = {"op": op, "digest": digest(op, kwargs), "task_id": task_id}
    if r.set(_key(site, unit_id), json.dumps(mine), nx=True, ex=TTL):
        return mine
    raw = r.get(_key(site, unit_id))
    if raw is None:                       # released between our two calls
        return claim(r, site, unit_id, op, kwargs, task_id)
    return json.loads(raw)


def release(r: redis.Redis, site: str, unit_id: str, task_id: str) -> None:
    """Drop the claim if *task_id* still holds it (compare-and-delete)."""
    script = ("local v = redis.call('get', KEYS[1]) "
              "if v and cjson.decode(v)['task_id'] == ARGV[1] then return redis.call('del', KEYS[1]) end "
              "return 0")
    r.eval(script, 1, _key(site, unit_id), task_id)


def holder(r: redis.Redis, site: str, unit_id: str) -> dict | None:
    raw = r.get(_key(site, unit_id))
    return json.loads(raw) if raw else None
