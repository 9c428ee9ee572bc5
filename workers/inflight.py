"""The per-unit in-flight marker in the site's Redis.

One operation per unit at a time: an identical request joins the task in
flight; a different one is refused (ABORTED at the gRPC edge).

A claim is a lease. It is taken for PENDING seconds only, and held for TTL once its task
is on the queue (``confirm``: by the caller that sent it, and again by the worker that
starts it). A caller that dies between its claim and its send (a plugin killed mid-RPC)
leaves no task behind; its claim then lapses within PENDING and the CO's retry runs the
operation anew, instead of following a task that will never run for TTL. A caller that
follows a claim also looks whether its task still exists (``presence``), and takes over a
claim whose task is nowhere.
"""
from __future__ import annotations

import hashlib
import json

import redis

TTL = 6 * 3600
PENDING = 15          # seconds a claim lives before its task is known to be queued

# act on the claim only while ARGV[1] holds it
_IF_HELD = ("local v = redis.call('get', KEYS[1]) "
            "if v and cjson.decode(v)['task_id'] == ARGV[1] then return redis.call({}) end "
            "return 0")
_CONFIRM = _IF_HELD.format("'expire', KEYS[1], ARGV[2]")
_RELEASE = _IF_HELD.format("'del', KEYS[1]")


def key(site: str, unit_id: str) -> str:
    return f"drsvc:{site}:inflight:{unit_id}"


def digest(op: str, kwargs: dict) -> str:
    return hashlib.sha256(json.dumps([op, kwargs], sort_keys=True).encode()).hexdigest()[:16]


def claim(r: redis.Redis, site: str, unit_id: str, op: str, kwargs: dict, task_id: str, *,
          pending: float = PENDING) -> dict:
    """Claim the unit for *task_id* (for *pending* seconds, until ``confirm``), or return
    the claim already held."""
    mine = {"op": op, "digest": digest(op, kwargs), "task_id": task_id}
    if r.set(key(site, unit_id), json.dumps(mine), nx=True, px=max(1, int(pending * 1000))):
        return mine
    raw = r.get(key(site, unit_id))
    if raw is None:                       # released (or lapsed) between our two calls
        return claim(r, site, unit_id, op, kwargs, task_id, pending=pending)
    return json.loads(raw)


def confirm(r: redis.Redis, site: str, unit_id: str, task_id: str) -> bool:
    """*task_id* is queued (or running): hold its claim for TTL. False if the claim is not
    its own any more (it lapsed, or a retry took the unit meanwhile)."""
    return bool(r.eval(_CONFIRM, 1, key(site, unit_id), task_id, TTL))


def release(r: redis.Redis, site: str, unit_id: str, task_id: str) -> None:
    """Drop the claim if *task_id* still holds it (compare-and-delete)."""
    r.eval(_RELEASE, 1, key(site, unit_id), task_id)


def holder(r: redis.Redis, site: str, unit_id: str) -> dict | None:
    raw = r.get(key(site, unit_id))
    return json.loads(raw) if raw else None
