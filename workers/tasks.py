"""Celery tasks: thin wrappers that reload state by ID and call the core.

Tasks take IDs and plain options (never secrets), are idempotent, run with
acks_late, and retry with backoff only on transient errors (Unavailable).
"""
from __future__ import annotations

import logging
import os
import random

import redis
from celery.exceptions import Ignore

from drsvc.dispatch import error_to_dict
from drsvc.errors import DrsvcError, Unavailable

from . import inflight, slots
from .titles import keep_worker_titles

log = logging.getLogger(__name__)
OPS = ("enable", "disable", "promote", "demote", "resync", "sync")
_services: dict = {}


def jobs_for(app):
    """The site's replication jobs (drsvc.replication.jobs), built once per worker process."""
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
        from drsvc.replication.api import ReplicationAPI
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


def register(app) -> None:
    cfg = app.drsvc_config

    def _take_slot(r, peer: str, task_id: str):
        """A held slot of *peer* (None: every slot is busy)."""
        slot = slots.Slot(r, cfg.scope, peer, ttl=cfg.visibility_timeout, label=task_id)
        try:
            return slot if slot.acquire(cfg.peer_sync_slots(peer, app.conf.worker_concurrency or 2)) else None
        except redis.RedisError as e:      # the sync needs no Redis: run it uncapped
            log.warning("peer sync slots unavailable (%s): running uncapped", type(e).__name__)
            return slots.Slot(r, cfg.scope, peer, ttl=cfg.visibility_timeout)

    def _hold_claim(r, unit_id: str, task_id: str) -> None:
        """This task runs: its claim (if a caller took one) lives on even if that caller
        died before it could confirm the send."""
        try:
            inflight.confirm(r, cfg.scope, unit_id, task_id)
        except redis.RedisError as e:
            log.warning("could not confirm the in-flight marker of %s: %s", unit_id, e)

    def make(op: str):
        @app.task(name=f"drsvc.{op}", bind=True, acks_late=True, max_retries=8)
        def task(self, unit_id: str, **kwargs):
            jobs = jobs_for(app)
            r = jobs.dispatcher.redis         # one client per worker process
            retrying = False
            slot = None
            try:
                _hold_claim(r, unit_id, self.request.id)
                if op == "sync" and (peer := jobs.peer_of(unit_id)):
                    slot = _take_slot(r, peer, self.request.id)
                    if slot is None:
                        # every slot of this peer is busy (a slow peer): leave the process to
                        # other peers' syncs and come back; same task id, so a caller waiting
                        # on it still gets the result
                        retrying = True
                        self.apply_async(args=[unit_id], kwargs=kwargs, task_id=self.request.id,
                                         countdown=1.0 + random.random(), queue=cfg.queue_for(op))
                        raise Ignore()
                out = getattr(jobs, f"run_{op}")(unit_id, **kwargs)
                return {"ok": True, **(out or {})}
            except Ignore:
                raise
            except Unavailable as e:
                # transient (peer or Redis down): scheduled syncs retry with backoff
                if op == "sync" and self.request.retries < self.max_retries:
                    retrying = True
                    raise self.retry(countdown=min(60, 2 ** self.request.retries), exc=e) from e
                return error_to_dict(e)
            except DrsvcError as e:
                return error_to_dict(e)
            except Exception as e:  # noqa: BLE001 - a task reports, it does not die
                log.exception("drsvc.%s %s failed", op, unit_id)
                return {"ok": False, "error": "InternalError", "message": f"{type(e).__name__}: {e}"}
            finally:
                if slot is not None:
                    try:
                        slot.release()
                    except redis.RedisError as e:
                        log.warning("could not release sync slot %s (it lapses): %s", slot.holder, e)
                if not retrying:
                    try:
                        inflight.release(r, cfg.scope, unit_id, self.request.id)
                        if op == "sync":
                            r.delete(sync_marker(cfg.scope, unit_id))
                    except redis.RedisError as e:
                        log.warning("could not release in-flight marker of %s: %s", unit_id, e)
        return task

    for op in OPS:
        make(op)

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


def worker_main(argv=None) -> int:
    """`drsvc worker --config site.toml [--role data|control|node] [--node NAME]`: a Celery
    worker of this site.

    A data worker serves the data queue (syncs) and, when a process is free, the control
    queue too, so a site with no control worker still answers. A control worker serves only
    the control queue: enable, disable, promote, demote and resync never wait behind syncs.
    With --node (a site of several storage nodes), the same for that node's queues
    drsvc.<site>.<node>[.control], over its pool; role api serves the node's
    drsvc.<site>.<node>.api, the site controller's calls on that pool, in threads."""
    import argparse
    from drsvc.config import load
    from .app import make_app
    ap = argparse.ArgumentParser(prog="drsvc worker")
    ap.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"), required=not os.environ.get("DRSVC_CONFIG"))
    ap.add_argument("--role", choices=("data", "control", "api"), default="data")
    ap.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""),
                    help="this storage node's name in the site config's [nodes] (default: $DRSVC_NODE)")
    ap.add_argument("--concurrency", type=int, default=None, help="processes (threads for api); default 2 (api 8)")
    ap.add_argument("--loglevel", default="INFO")
    ap.add_argument("--hostname", default=None)
    args = ap.parse_args(argv)
    if args.role == "api" and not args.node:
        ap.error("--role api is a storage node's: it needs --node (or DRSVC_NODE)")
    cfg = load(args.config, node=args.node)
    app = make_app(cfg)
    args.concurrency = args.concurrency or (8 if args.role == "api" else 2)
    app.conf.worker_concurrency = args.concurrency     # the per-peer sync slots follow it
    queues = {"data": f"{cfg.queue},{cfg.control_queue}", "control": cfg.control_queue,
              "api": cfg.api_queue(args.node) if args.role == "api" else ""}[args.role]
    pool = ["-P", "threads"] if args.role == "api" else []   # its calls wait on the node's jobs
    wargs = ["worker", "-Q", queues, *pool, "-c", str(args.concurrency), "-l", args.loglevel, "-E",
             "-n", args.hostname or f"{worker_name(cfg, args.role)}@%h", "--without-gossip", "--without-mingle"]
    keep_worker_titles("worker", cfg, "" if args.role == "data" else args.role)
    if args.role in ("data", "control"):
        keep_peers_warm(cfg)
    app.worker_main(wargs)
    return 0


WARM_EVERY = 300.0       # seconds; a warm receiver is dropped after remote.IDLE_TTL (600) unused


def keep_peers_warm(cfg) -> None:
    """Each pool process logs in to every peer when it starts, and greets a receiver there
    every WARM_EVERY seconds: a Demote's final sync, or the first sync after a quiet spell,
    then costs its round trips, not a login's (about nine over SSH)."""
    from celery import signals

    def loop():
        import time

        from drsvc.replication import remote
        from drsvc.replication.peers import connect
        while True:
            for p in cfg.peers.values():
                try:
                    peer = connect(p)
                    if peer.session_key is not None:     # a transport that keeps connections
                        remote.warm(peer)
                except Exception as e:  # noqa: BLE001 - the peer may be down; syncs report that
                    log.debug("peer %s not warmed: %s", p.name, e)
            time.sleep(WARM_EVERY)

    def on_child(**_):
        import threading
        threading.Thread(target=loop, name="drsvc-warm-peers", daemon=True).start()
    signals.worker_process_init.connect(on_child, weak=False)


def worker_name(cfg, role: str) -> str:
    """The Celery node name of this site's (or node's) worker of *role*, before the @host:
    "a", "a-control", "a.n1-api". workers/probe.py pings it by this name."""
    return cfg.scope if role == "data" else f"{cfg.scope}-{role}"
