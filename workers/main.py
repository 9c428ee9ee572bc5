"""`drsvc worker`: a Celery worker of one site (or of one storage node of it)."""
from __future__ import annotations

import argparse
import os

from drsvc.config import load

from .app import make_app


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
    queues, name = {"data": (f"{cfg.queue},{cfg.control_queue}", cfg.scope),
                    "control": (cfg.control_queue, f"{cfg.scope}-control"),
                    "api": (cfg.api_queue(args.node) if args.role == "api" else "", f"{cfg.scope}-api")}[args.role]
    pool = ["-P", "threads"] if args.role == "api" else []   # its calls wait on the node's jobs
    wargs = ["worker", "-Q", queues, *pool, "-c", str(args.concurrency), "-l", args.loglevel, "-E",
             "-n", args.hostname or f"{name}@%h", "--without-gossip", "--without-mingle"]
    app.worker_main(wargs)
    return 0
