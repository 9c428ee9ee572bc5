"""Celery tasks: thin wrappers that reload state by ID and call the core.

Tasks take IDs and plain options (never secrets), are idempotent, run with
acks_late, and retry with backoff only on transient errors (Unavailable).
"""
from __future__ import annotations

import logging
import random
import threading
import time

import redis
from celery.exceptions import Ignore

from drsvc.config import DATA_OPS
from drsvc.dispatch import error_to_dict
from drsvc.errors import BrokerUnreachable, DrsvcError, TaskSuperseded, Unavailable

from . import inflight, slots

log = logging.getLogger(__name__)

RELEASE_RETRY_S = 120.0   # how long a finished task keeps trying to drop its claim while Redis is away
OPS = ("enable", "disable", "promote", "promote_all", "demote", "demote_all", "resync", "sync", "verify")
_services: dict = {}


def jobs_for(app):
    """The site's replication jobs (drsvc.replication.control.jobs), built once per worker process."""
    key = id(app)
    if key not in _services:
        from drsvc.site import Site
        from .client import CeleryDispatcher
        site = Site.from_config(app.drsvc_config, dispatcher=CeleryDispatcher(app))
        _services[key] = site.replication.jobs
    return _services[key]


def node_ops_for(app):
    """This storage node's side of its site controller's calls (drsvc.cluster.NodeOps)."""
    key = ("node", id(app))
    if key not in _services:
        from drsvc.cluster import NodeOps
        from drsvc.controller import PoolController
        from drsvc.replication.control import ReplicationAPI
        from drsvc.site import Site
        from .client import CeleryDispatcher
        from .client import RedisBarrier
        cfg = app.drsvc_config
        dispatcher = CeleryDispatcher(app)
        site = Site.from_config(cfg, dispatcher=dispatcher)

        def barrier(name: str, parties: int, timeout: float):
            return RedisBarrier(dispatcher.redis, f"drsvc:{cfg.site}:barrier:{name}", parties, timeout)
        _services[key] = NodeOps(PoolController(site), ReplicationAPI(site.status, site.replication.requests)
                                 if cfg.peers else None, barrier)
    return _services[key]


def sync_marker(site: str, unit_id: str) -> str:
    return f"drsvc:{site}:sync-queued:{unit_id}"


def verify_marker(site: str, unit_id: str) -> str:
    return f"drsvc:{site}:verify-queued:{unit_id}"


def _take_slot(app, r, peer: str, task_id: str):
    """A held slot of *peer* (None: every slot is busy)."""
    cfg = app.drsvc_config
    slot = slots.Slot(r, cfg.scope, peer, ttl=cfg.visibility_timeout, label=task_id)
    try:
        return slot if slot.acquire(cfg.peer_sync_slots(peer, app.conf.worker_concurrency or 2)) else None
    except redis.RedisError as e:      # the sync needs no Redis: run it uncapped
        log.warning("peer sync slots unavailable (%s): running uncapped", type(e).__name__)
        return slots.Slot(r, cfg.scope, peer, ttl=cfg.visibility_timeout)


# Operations that change a unit's role or its data: they run only for a caller that
# still waits (their claim is theirs). A copy of one that outlived its caller (a message
# redelivered by the visibility sweep after a Redis restart, or published twice) would
# otherwise act later on a unit whose role has moved on since: promote it again, or demote
# the site the operator has since failed over to. Every operation but the data queue's
# (syncs, run by whoever sends them, a scheduler included, and harmless twice).
FENCED_OPS = frozenset(OPS) - DATA_OPS


def _hold_claim(cfg, r, unit_id: str, task_id: str) -> bool | None:
    """This task runs: its claim (if a caller took one) lives on even if that caller
    died before it could confirm the send. True: the claim is this task's; False: it is
    gone or another's; None: Redis did not answer."""
    try:
        return inflight.confirm(r, cfg.scope, unit_id, task_id)
    except redis.RedisError as e:
        log.warning("could not confirm the in-flight marker of %s: %s", unit_id, e)
        return None


class OpRun:
    """One run of a drsvc.<op> task: hold the caller's claim, take a sync slot of the peer
    (or come back later under the same task id), run the job, answer with plain data, and
    release the slot, and the claim unless the task comes back."""

    def __init__(self, app, task, op: str, unit_id: str, kwargs: dict):
        self.app, self.cfg, self.task, self.op = app, app.drsvc_config, task, op
        self.unit_id, self.kwargs = unit_id, kwargs
        self.jobs = jobs_for(app)
        self.r = self.jobs.dispatcher.redis         # one client per worker process
        self.slot = None
        self.coming_back = False

    def __call__(self) -> dict:
        try:
            return self._answer()
        finally:
            self._release()

    def _answer(self) -> dict:
        try:
            return {"ok": True, **(self._run() or {})}
        except Ignore:
            raise
        except Unavailable as e:
            # transient (peer or Redis down): scheduled syncs retry with backoff
            if self.op == "sync" and self.task.request.retries < self.task.max_retries:
                self.coming_back = True
                raise self.task.retry(countdown=min(60, 2 ** self.task.request.retries), exc=e) from e
            return error_to_dict(e)
        except DrsvcError as e:
            return error_to_dict(e)
        except Exception as e:  # noqa: BLE001 - a task reports, it does not die
            log.exception("drsvc.%s %s failed", self.op, self.unit_id)
            return {"ok": False, "error": "InternalError", "message": f"{type(e).__name__}: {e}"}

    def _run(self):
        task_id = self.task.request.id
        held = _hold_claim(self.cfg, self.r, self.unit_id, task_id)
        if self.op in FENCED_OPS and not held:
            if held is None:
                raise BrokerUnreachable(reason=f"the claim of {self.op} of {self.unit_id} could not be "
                                               "checked; not run (the caller's retry runs it)")
            log.warning("drsvc.%s %s: task %s no longer holds the unit's claim; not run",
                        self.op, self.unit_id, task_id)
            raise TaskSuperseded(op=self.op, unit_id=self.unit_id, task_id=task_id)
        if self.op == "sync" and (peer := self.jobs.peer_of(self.unit_id)):
            self.slot = _take_slot(self.app, self.r, peer, task_id)
            if self.slot is None:
                # every slot of this peer is busy (a slow peer): leave the process to other
                # peers' syncs and come back; same task id, so a caller waiting on it still
                # gets the result
                self.coming_back = True
                self.task.apply_async(args=[self.unit_id], kwargs=self.kwargs, task_id=task_id,
                                      countdown=1.0 + random.random(), queue=self.cfg.queue_for(self.op))
                raise Ignore()
        return getattr(self.jobs, f"run_{self.op}")(self.unit_id, **self.kwargs)

    def _release(self) -> None:
        if self.slot is not None:
            try:
                self.slot.release()
            except redis.RedisError as e:
                log.warning("could not release sync slot %s (it lapses): %s", self.slot.holder, e)
        if self.coming_back:
            return
        task_id = self.task.request.id     # now: the task object serves the next request later
        try:
            inflight.release(self.r, self.cfg.scope, self.unit_id, task_id)
            if self.op in ("sync", "verify"):
                marker = sync_marker if self.op == "sync" else verify_marker
                self.r.delete(marker(self.cfg.scope, self.unit_id))
        except redis.RedisError as e:
            # Redis away as the task ends (a restart): its answer may be lost with it, and a
            # claim left held would make every retry follow this finished task for hours.
            # Keep trying while the broker comes back; the CO's retry then runs anew.
            log.warning("could not release in-flight marker of %s (%s); retrying in the background",
                        self.unit_id, e)
            threading.Thread(target=self._release_later, args=(task_id,), name=f"drsvc-release-{self.unit_id}",
                             daemon=True).start()

    def _release_later(self, task_id: str, for_s: float = RELEASE_RETRY_S) -> None:
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                inflight.release(self.r, self.cfg.scope, self.unit_id, task_id)   # only if still ours
                log.info("released the in-flight marker of %s", self.unit_id)
                return
            except redis.RedisError:
                continue
        log.warning("gave up releasing the in-flight marker of %s; it lapses with its TTL", self.unit_id)


def _op_task(app, op: str):
    @app.task(name=f"drsvc.{op}", bind=True, acks_late=True, max_retries=8)
    def task(self, unit_id: str, **kwargs):
        return OpRun(app, self, op, unit_id, kwargs)()
    return task


def register(app) -> None:
    for op in OPS:
        _op_task(app, op)

    @app.task(name="drsvc.node", acks_late=True)
    def node_call(op: str, kwargs: dict):
        """One call of the site's controller on this node's pool (a multi-node site)."""
        try:
            return {"ok": True, "value": node_ops_for(app).run(op, kwargs)}
        except DrsvcError as e:
            return error_to_dict(e)
        except Exception as e:  # noqa: BLE001 - a task reports, it does not die
            log.exception("drsvc.node %s failed", op)
            return {"ok": False, "error": "InternalError", "message": f"{type(e).__name__}: {e}"}
