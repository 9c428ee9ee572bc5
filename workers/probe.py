"""Liveness probes for the pods (deploy/): exit 0 when the process answers, 1 with the reason.

  python -m workers.probe --config site.toml worker --role data|control|api
      the worker of that role on this host answers a Celery ping by its node name
      (workers.main.worker_name, @ this host's name: the pod's);
  python -m workers.probe --config site.toml scheduler --heartbeat FILE [--max-age 60]
      the scheduler's loop touched FILE (its --heartbeat) within --max-age seconds.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path


def probe_worker(cfg, role: str, timeout: float) -> str | None:
    from .app import make_app
    from .main import worker_name
    name = f"{worker_name(cfg, role)}@{socket.gethostname()}"
    app = make_app(cfg)
    try:
        replies = app.control.ping(destination=[name], timeout=timeout)
    except Exception as e:  # noqa: BLE001 - any failure to reach it is the answer
        return f"worker {name}: {type(e).__name__}: {e}"
    if not any(name in r for r in replies):
        return f"worker {name} did not answer a ping within {timeout:.0f}s"
    return None


def probe_scheduler(heartbeat: str, max_age: float) -> str | None:
    try:
        age = time.time() - Path(heartbeat).stat().st_mtime
    except FileNotFoundError:
        return f"scheduler heartbeat {heartbeat} does not exist (is it started with --heartbeat {heartbeat}?)"
    if age > max_age:
        return f"scheduler heartbeat {heartbeat} is {age:.0f}s old (more than {max_age:.0f}s)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"), required=not os.environ.get("DRSVC_CONFIG"))
    ap.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""))
    sub = ap.add_subparsers(dest="what", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--role", choices=("data", "control", "api"), default="data")
    w.add_argument("--timeout", type=float, default=10.0)
    s = sub.add_parser("scheduler")
    s.add_argument("--heartbeat", required=True)
    s.add_argument("--max-age", type=float, default=60.0)
    args = ap.parse_args(argv)
    from drsvc.config import load
    if args.what == "worker":
        problem = probe_worker(load(args.config, node=args.node), args.role, args.timeout)
    else:
        problem = probe_scheduler(args.heartbeat, args.max_age)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
