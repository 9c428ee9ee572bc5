"""The long-running processes (`drsvc worker|scheduler|metrics|flower`) and the demo."""
from __future__ import annotations

import os

from .context import config_path, load_config
from .errors import EXIT_OK, UsageError

# Flower's task list: the name is "drsvc.<op> <unit>" (workers.app.label_task), kwargs carry the
# trigger and, for a scheduled sync, its slot in UTC
TASK_COLUMNS = "name,kwargs,state,result,received,started,runtime,worker,args,uuid"


def cmd_flower(args, out):
    """Celery Flower for this site's workers (task names and arguments; no secrets travel in tasks).
    Its history is kept in the site's run directory, so a restart keeps the tasks seen."""
    from drsvc.sitectl import SiteRun
    from workers.app import make_app
    cfg = load_config(config_path(args))
    app = make_app(cfg)
    os.environ.setdefault("DRSVC_CONFIG", str(cfg.path))
    db = SiteRun(cfg).run_dir / "flower.db"
    argv = ["flower", f"--port={args.port}", f"--address={args.address}", "--persistent=True", f"--db={db}",
            "--state_save_interval=30000", f"--tasks_columns={TASK_COLUMNS}"]
    app.start(argv)
    return EXIT_OK


def cmd_worker(args, out):
    from workers.main import worker_main
    path = config_path(args)
    load_config(path)
    argv = ["--config", path, "--role", args.role, "--node", args.node]
    return worker_main(argv + (["--concurrency", str(args.concurrency)] if args.concurrency else []))


def cmd_scheduler(args, out):
    from workers.scheduler import main
    path = config_path(args)
    load_config(path)
    return main(["--config", path, "--node", args.node] + (["--heartbeat", args.heartbeat] if args.heartbeat else []))


def cmd_metrics(args, out):
    from workers.metrics import main
    path = config_path(args)
    load_config(path)
    return main(["--config", path, "--address", args.address, "--node", args.node])


def cmd_demo(args, out):
    from drsvc_lab.demo.run import demo_down, run_demo
    if getattr(args, "action", None) == "down":
        if not args.root:
            raise UsageError("demo down needs --root DIR (printed by `drsvc demo --keep`)")
        return demo_down(args.root, as_json=args.json)
    return run_demo(keep=args.keep, as_json=args.json, root=args.root)


def add_parsers(sub, common) -> None:
    p = sub.add_parser("flower", parents=[common], help="Celery Flower for this site's workers")
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(fn=cmd_flower)
    for name, fn in (("worker", cmd_worker), ("scheduler", cmd_scheduler), ("metrics", cmd_metrics)):
        p = sub.add_parser(name, parents=[common], help=f"run this site's {name}")
        p.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""),
                       help="a multi-node site: this storage node's name in [nodes] (default: $DRSVC_NODE)")
        p.set_defaults(fn=fn)
        if name == "metrics":
            p.add_argument("--address", default="127.0.0.1", help="listen address (0.0.0.0 in a pod)")
        if name == "scheduler":
            p.add_argument("--heartbeat", help="a file touched on every loop (liveness: python -m workers.probe)")
        if name == "worker":
            p.add_argument("--role", choices=("data", "control", "api"), default="data",
                           help="data: syncs (and control when idle); control: only the control queue; "
                                "api: a storage node's calls from its site controller (needs --node)")
            p.add_argument("--concurrency", type=int, default=None, help="processes (api: threads); default 2 (api 8)")
    p = sub.add_parser("demo", parents=[common], help="the two-site DR demo on this host; `demo down` removes it")
    p.add_argument("--keep", action="store_true", help="leave the sites running afterwards")
    p.add_argument("--root", default=None, help="work directory (default: a new temp dir)")
    acts = p.add_subparsers(dest="action")
    q = acts.add_parser("down", parents=[common], help="stop and remove what `demo --keep` left running")
    q.add_argument("--root", default=None, help="the demo's work directory")
    p.set_defaults(fn=cmd_demo)
