"""`drsvc`: DR runbooks over the plugin socket (the same API a CO uses).

Exit codes (also in the README):
  0 success, 1 failure, 2 usage error, 3 retryable (operation in progress or
  site unavailable), 4 refused (a precondition failed), 5 not found.
With --json every command prints one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import grpc

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_RETRY, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4, 5
_EXIT_BY_CODE = {grpc.StatusCode.ABORTED: EXIT_RETRY, grpc.StatusCode.UNAVAILABLE: EXIT_RETRY,
                 grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_RETRY,
                 grpc.StatusCode.FAILED_PRECONDITION: EXIT_REFUSED, grpc.StatusCode.ALREADY_EXISTS: EXIT_REFUSED,
                 grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
                 grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE}


class Output:
    """Tables and progress for people; one JSON object for machines."""

    def __init__(self, as_json: bool):
        self.json = as_json
        self.console = None
        if not as_json:
            from rich.console import Console
            self.console = Console()

    def result(self, command: str, result) -> int:
        if self.json:
            print(json.dumps({"ok": True, "command": command, "result": result}, sort_keys=True, default=str))
        elif isinstance(result, list) and result and isinstance(result[0], dict):
            self.table(result)
        elif isinstance(result, dict):
            for k, v in result.items():
                self.console.print(f"[bold]{k}[/bold]: {v}")
        elif result is not None:
            self.console.print(result)
        return EXIT_OK

    def error(self, command: str, code: str, message: str, exit_code: int) -> int:
        if self.json:
            print(json.dumps({"ok": False, "command": command, "exit_code": exit_code,
                              "error": {"code": code, "message": message}}, sort_keys=True))
        else:
            self.console.print(f"[red]error[/red] ({code}): {message}")
        return exit_code

    def table(self, rows: list[dict], columns: list[str] | None = None, title: str | None = None) -> None:
        from rich.table import Table
        cols = columns or list(rows[0].keys())
        t = Table(title=title)
        for c in cols:
            t.add_column(c)
        for r in rows:
            t.add_row(*[_cell(r.get(c)) for c in cols])
        self.console.print(t)

    def progress(self, label: str):
        """A spinner in a terminal; silent with --json or without a tty."""
        import contextlib
        if self.json or not sys.stderr.isatty():
            return contextlib.nullcontext(lambda msg: None)
        from rich.console import Console
        status = Console(stderr=True).status(label)

        class _P:
            def __enter__(self_inner):
                status.__enter__()
                return lambda msg: status.update(f"{label}: {msg}")

            def __exit__(self_inner, *exc):
                status.__exit__(*exc)
        return _P()


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def _when(ts) -> str:
    if not ts:
        return "never"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _endpoint(args) -> str:
    if args.endpoint:
        return args.endpoint
    if args.config:
        from drsvc.config import load
        return load(args.config).endpoint
    if os.environ.get("CSI_ENDPOINT"):
        return os.environ["CSI_ENDPOINT"]
    raise SystemExit("drsvc: give --endpoint, --config or set DRSVC_CONFIG / CSI_ENDPOINT")


def _unit(args) -> dict:
    if bool(args.volume) == bool(args.group):
        raise SystemExit("drsvc: give exactly one of --volume or --group")
    return {"volume_id": args.volume} if args.volume else {"group_id": args.group}


def _client(args):
    from .client import DrClient
    return DrClient(_endpoint(args), timeout=args.timeout)


# -- commands ---------------------------------------------------------------------------
def cmd_site(args, out: Output):
    from drsvc.config import load
    from drsvc.sitectl import SiteRun
    run = SiteRun(load(args.config))
    if args.action == "up":
        run.up()
    elif args.action == "down":
        run.down()
    status = run.status()
    rows = [{"component": c, "pid": pid, "running": pid is not None} for c, pid in status.items()]
    if out.json:
        return out.result(f"site {args.action}", {"site": run.cfg.site, "components": rows})
    out.table(rows, title=f"site {run.cfg.site}")
    return EXIT_OK


def cmd_volume(args, out: Output):
    with _client(args) as c:
        if args.action == "create":
            return out.result("volume create", c.create_volume(args.name, _size(args.size), fs_type=args.fs_type,
                                                                group_id=args.group or ""))
        if args.action == "list":
            return out.result("volume list", c.list_volumes())
        c.delete_volume(args.volume_id)
        return out.result("volume delete", {"volume_id": args.volume_id, "deleted": True})


def cmd_group(args, out: Output):
    with _client(args) as c:
        if args.action == "create":
            return out.result("group create", c.create_group(args.name))
        if args.action == "list":
            return out.result("group list", c.list_groups())
        c.delete_group(args.group_id)
        return out.result("group delete", {"group_id": args.group_id, "deleted": True})


_RPC = {"enable": "EnableVolumeReplication", "disable": "DisableVolumeReplication",
        "promote": "PromoteVolume", "demote": "DemoteVolume"}


def cmd_replication(args, out: Output):
    unit = _unit(args)
    with _client(args) as c:
        fields = {}
        if args.command == "enable":
            params = {"schedulingInterval": args.interval}
            if args.peer:
                params["peer"] = args.peer
            if args.start_time:
                params["schedulingStartTime"] = args.start_time
            fields["parameters"] = params
        if args.command == "promote":
            fields["force"] = args.force
        with out.progress(f"{args.command} {next(iter(unit.values()))}") as tick:
            c.until_done(lambda: c.replication(_RPC[args.command], **unit, **fields), wait=args.wait,
                         progress=tick)
        try:
            state = c.status(**unit)
        except Exception:  # noqa: BLE001 - after disable there is nothing to show
            state = {"enabled": False}
        return out.result(args.command, state)


def cmd_resync(args, out: Output):
    unit = _unit(args)
    with _client(args) as c:
        deadline = time.monotonic() + (args.wait if args.wait_ready else 0)
        with out.progress("resync") as tick:
            while True:
                resp = c.until_done(lambda: c.replication("ResyncVolume", **unit), wait=60, progress=tick)
                if resp.ready or time.monotonic() > deadline:
                    break
                tick("waiting for the primary's next sync")
                time.sleep(1)
        result = {"ready": resp.ready, **c.status(**unit)}
        out.result("resync", result)
        return EXIT_OK if resp.ready or not args.wait_ready else EXIT_RETRY


def cmd_sync_now(args, out: Output):
    unit = _unit(args)
    with _client(args) as c:
        with out.progress("sync") as tick:
            r = c.until_done(lambda: c.sync_now(**unit, wait=args.wait if args.wait_done else 1.0),
                             wait=args.wait if args.wait_done else 0, progress=tick)
        return out.result("sync-now", r)


def cmd_status(args, out: Output):
    single = bool(args.volume or args.group)
    with _client(args) as c:
        rows = [c.status(**_unit(args))] if single else c.statuses()
    if out.json:   # one unit: its object; no unit: the list of all
        return out.result("status", rows[0] if single else rows)
    view = [{"unit": r["unit_id"], "kind": r["kind"], "role": r["role"], "peer": r["peer"], "epoch": r["epoch"],
             "gen": r["generation"], "last sync": _when(r["last_sync_time"]),
             "duration": f"{r['last_sync_duration']:.2f}s", "bytes": r["last_sync_bytes"],
             "lag": f"{r['lag_seconds']:.0f}s/{r['interval_seconds']}s", "health": r["status"],
             "message": r["status_message"]} for r in rows]
    if view:
        out.table(view, title="replication")
    else:
        out.console.print("no replicated volumes or groups")
    return EXIT_OK


def cmd_clone(args, out: Output):
    with _client(args) as c:
        return out.result("clone", c.clone_replica(args.prefix, **_unit(args)))


def cmd_flower(args, out: Output):
    """Celery Flower for this site's workers (task names and arguments; no secrets travel in tasks)."""
    from drsvc.config import load
    from workers.app import make_app
    cfg = load(args.config)
    app = make_app(cfg)
    os.environ.setdefault("DRSVC_CONFIG", str(cfg.path))
    argv = ["flower", f"--port={args.port}", f"--address={args.address}", "--persistent=False"]
    app.start(argv)
    return EXIT_OK


def cmd_worker(args, out: Output):
    from workers.tasks import worker_main
    return worker_main(["--config", args.config])


def cmd_scheduler(args, out: Output):
    from workers.scheduler import main
    return main(["--config", args.config])


def cmd_metrics(args, out: Output):
    from workers.metrics import main
    return main(["--config", args.config, "--address", args.address])


def cmd_demo(args, out: Output):
    from .demo import run_demo
    return run_demo(keep=args.keep, as_json=args.json, root=args.root)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("ib").rstrip("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"), help="site config (TOML)")
    common.add_argument("--endpoint", help="plugin socket, unix:///path (default: from --config)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--timeout", type=float, default=60.0, help="per-RPC timeout, seconds")
    unit = argparse.ArgumentParser(add_help=False)
    unit.add_argument("--volume", help="volume id")
    unit.add_argument("--group", help="volume group id")

    ap = argparse.ArgumentParser(prog="drsvc", description="drsvc disaster-recovery runbooks",
                                 epilog="exit codes: 0 ok, 1 failure, 2 usage, 3 retryable, 4 refused, 5 not found")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("site", parents=[common], help="start/stop/inspect this site's processes")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(fn=cmd_site)
    p = sub.add_parser("volume", parents=[common], help="create, list, delete volumes")
    p.add_argument("action", choices=["create", "list", "delete"])
    p.add_argument("name_or_id", nargs="?")
    p.add_argument("--size", default="1G")
    p.add_argument("--fs-type", default="ext4", choices=["ext4", "xfs"])
    p.add_argument("--group", help="join this volume group")
    p.set_defaults(fn=cmd_volume)
    p = sub.add_parser("group", parents=[common], help="create, list, delete volume groups")
    p.add_argument("action", choices=["create", "list", "delete"])
    p.add_argument("name_or_id", nargs="?")
    p.set_defaults(fn=cmd_group)
    for name, helptext in (("enable", "enable replication"), ("disable", "end replication on both sides"),
                           ("promote", "make this site primary"), ("demote", "make this site secondary")):
        p = sub.add_parser(name, parents=[common, unit], help=helptext)
        p.add_argument("--wait", type=float, default=120, help="keep retrying an in-progress answer this long")
        if name == "enable":
            p.add_argument("--interval", default="5m")
            p.add_argument("--peer")
            p.add_argument("--start-time")
        if name == "promote":
            p.add_argument("--force", action="store_true", help="promote with the peer unreachable (fences it)")
        p.set_defaults(fn=cmd_replication)
    p = sub.add_parser("resync", parents=[common, unit], help="discard local divergence and follow the primary")
    p.add_argument("--wait", dest="wait_ready", action="store_true", help="wait until the copy is consistent")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=300)
    p.set_defaults(fn=cmd_resync)
    p = sub.add_parser("sync-now", parents=[common, unit], help="sync now instead of waiting for the schedule")
    p.add_argument("--wait", dest="wait_done", action="store_true", help="wait for the sync to finish")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=300)
    p.set_defaults(fn=cmd_sync_now)
    p = sub.add_parser("status", parents=[common, unit], help="replication status table")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("clone", parents=[common, unit], help="clone the latest replicated generation (drills)")
    p.add_argument("--prefix", default="drill")
    p.set_defaults(fn=cmd_clone)
    p = sub.add_parser("flower", parents=[common], help="Celery Flower for this site's workers")
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(fn=cmd_flower)
    for name, fn in (("worker", cmd_worker), ("scheduler", cmd_scheduler), ("metrics", cmd_metrics)):
        p = sub.add_parser(name, parents=[common], help=f"run this site's {name}")
        if name == "metrics":
            p.add_argument("--address", default="127.0.0.1", help="listen address (0.0.0.0 in a pod)")
        p.set_defaults(fn=fn)
    p = sub.add_parser("demo", parents=[common], help="the two-site DR demo on this host")
    p.add_argument("--keep", action="store_true", help="leave the sites running afterwards")
    p.add_argument("--root", default=None, help="work directory (default: a new temp dir)")
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Output(getattr(args, "json", False))
    if args.command in ("volume", "group"):
        if args.action == "create" and not args.name_or_id:
            return out.error(args.command, "INVALID_ARGUMENT", "a name is required", EXIT_USAGE)
        if args.action == "delete" and not args.name_or_id:
            return out.error(args.command, "INVALID_ARGUMENT", "an id is required", EXIT_USAGE)
        args.name = args.volume_id = args.group_id = args.name_or_id
    from .client import RpcFailed
    try:
        return args.fn(args, out)
    except RpcFailed as e:
        return out.error(args.command, e.code.name, e.message, _EXIT_BY_CODE.get(e.code, EXIT_FAIL))
    except SystemExit as e:
        if isinstance(e.code, str):
            return out.error(args.command, "USAGE", e.code.removeprefix("drsvc: "), EXIT_USAGE)
        raise
    except Exception as e:  # noqa: BLE001 - a runbook gets a message and a code, not a traceback
        from drsvc.errors import DrsvcError
        msg = e.message if isinstance(e, DrsvcError) else f"{type(e).__name__}: {e}"
        return out.error(args.command, type(e).__name__, msg, EXIT_FAIL)


if __name__ == "__main__":
    raise SystemExit(main())
