"""`drsvc worker`: a Celery worker of one site (or of one storage node of it), with the
per-process helpers it starts (titles, warm peers, the engine preloaded)."""
from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import threading
import time

from celery import signals

from drsvc.config import load
from drsvc.replication.sender import warm
from drsvc.replication.control import JOB_MODULES, connect

from .app import make_app
from .titles import keep_worker_titles

log = logging.getLogger("drsvc.worker")


def worker_main(argv=None) -> int:
    """`drsvc worker --config site.toml [--role data|control|node] [--node NAME]`: a Celery
    worker of this site.

    A data worker serves the data queue (syncs) and, when a process is free, the control
    queue too, so a site with no control worker still answers. A control worker serves only
    the control queue: enable, disable, promote, demote and resync never wait behind syncs.
    With --node (a site of several storage nodes), the same for that node's queues
    drsvc.<site>.<node>[.control], over its pool; role api serves the node's
    drsvc.<site>.<node>.api, the site controller's calls on that pool, in threads."""
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
             "--heartbeat-interval", str(EVENT_HEARTBEAT_S),
             "-n", args.hostname or f"{worker_name(cfg, args.role)}@%h", "--without-gossip", "--without-mingle"]
    set_idle_poll()
    keep_worker_titles("worker", cfg, "" if args.role == "data" else args.role)
    if args.role in ("data", "control"):
        keep_peers_warm(cfg)
    preload(args.role)
    app.worker_main(wargs)
    return 0


# What the tasks import inside their functions (the plugin does not load them). The worker
# imports them once, before Celery forks its pool (or, role api, before its threads start), so
# a pool process has them from the start instead of paying for them (numpy most of it) in its
# first task, and again in every process that replaces one.
SITE_MODULES = ("drsvc.site", "workers.client")       # every role's tasks build the site's services
ENGINE_MODULES = (*JOB_MODULES, *SITE_MODULES)
# a storage node's api worker: the site controller's calls (``tasks.node_ops_for``)
NODE_MODULES = ("drsvc.cluster", "drsvc.controller", "drsvc.replication.control.api", *SITE_MODULES)
PRELOAD = {"data": ENGINE_MODULES, "control": ENGINE_MODULES, "api": NODE_MODULES}


def preload(role: str) -> None:
    """Import what *role*'s tasks import in their functions, before the pool starts; then
    freeze what is loaded out of the collector's reach. Celery collects before it forks each
    pool process, and a full collection walks every module's objects (about 45 ms a fork
    here); frozen, they are neither walked nor touched, so the children also keep sharing
    those pages with the parent instead of copying them when the collector writes."""
    for name in PRELOAD[role]:
        importlib.import_module(name)
    gc.freeze()


# An idle worker's wake-ups. Redis answers the BRPOP a worker waits in as soon as a task is
# queued; the timeout only bounds one wait before kombu sends it again, and kombu's 1 s made
# every idle worker wake and send a command each second. The worker-heartbeat events carry
# their interval, which Flower reads to tell an offline worker (after two missed).
IDLE_POLL_S = 5
EVENT_HEARTBEAT_S = 10


def set_idle_poll() -> None:
    from kombu.transport import redis as kombu_redis
    kombu_redis.Transport.brpop_timeout = IDLE_POLL_S


WARM_EVERY = 300.0       # seconds; a warm receiver is dropped after receiver_client.IDLE_TTL (600) unused


def keep_peers_warm(cfg) -> None:
    """Each pool process logs in to every peer when it starts, on every connection striping
    uses, and greets there the receivers a large sync takes (the master and its stripes,
    ``receiver_client.warm``) every WARM_EVERY seconds: a Demote's final sync, or the first sync after
    a quiet spell, then costs its round trips, not a login's (about nine over SSH) nor a
    receiver's start."""
    def loop():
        while True:
            for p in cfg.peers.values():
                try:
                    peer = connect(p)
                    if peer.session_key is not None:     # a transport that keeps connections
                        caps = cfg.bandwidth_caps(p.name).values()    # sizes N as a sync's limit does
                        warm(peer, bwlimit=min(caps) if caps else None)
                except Exception as e:  # noqa: BLE001 - the peer may be down; syncs report that
                    log.debug("peer %s not warmed: %s", p.name, e)
            time.sleep(WARM_EVERY)

    def on_child(**_):
        threading.Thread(target=loop, name="drsvc-warm-peers", daemon=True).start()
    signals.worker_process_init.connect(on_child, weak=False)


def worker_name(cfg, role: str) -> str:
    """The Celery node name of this site's (or node's) worker of *role*, before the @host:
    "a", "a-control", "a.n1-api". workers/probe.py pings it by this name."""
    return cfg.scope if role == "data" else f"{cfg.scope}-{role}"
