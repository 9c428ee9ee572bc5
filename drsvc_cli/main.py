"""`drsvc`: DR runbooks over the plugin socket (the same API a CO uses).

Exit codes (also in the README):
  0 success, 1 failure, 2 usage error, 3 retryable (operation in progress or
  site unavailable), 4 refused (a precondition failed), 5 not found.
With --json every command prints one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import grpc

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_RETRY, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4, 5
_EXIT_BY_CODE = {grpc.StatusCode.ABORTED: EXIT_RETRY, grpc.StatusCode.UNAVAILABLE: EXIT_RETRY,
                 grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_RETRY,
                 grpc.StatusCode.FAILED_PRECONDITION: EXIT_REFUSED, grpc.StatusCode.ALREADY_EXISTS: EXIT_REFUSED,
                 grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
                 grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE}


class CliError(Exception):
    """A runbook error found before or after the RPC: a message, a code name and an exit code."""
    code, exit_code = "FAILED", EXIT_FAIL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UsageError(CliError):
    code, exit_code = "USAGE", EXIT_USAGE


class NotFoundError(CliError):
    code, exit_code = "NOT_FOUND", EXIT_NOT_FOUND


class Refused(CliError):
    code, exit_code = "FAILED_PRECONDITION", EXIT_REFUSED


class ArgParser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so usage errors honour --json."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


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
            self.table([{"field": k, "value": v} for k, v in result.items()])
        elif result is not None:
            self.console.print(result)
        return EXIT_OK

    def error(self, command: str, code: str, message: str, exit_code: int) -> int:
        if self.json:
            print(json.dumps({"ok": False, "command": command, "exit_code": exit_code,
                              "error": {"code": code, "message": message}}, sort_keys=True))
        else:
            from rich.console import Console
            from rich.markup import escape
            Console(stderr=True).print(f"[red]error[/red] ({code}): {escape(message)}")
        return exit_code

    def table(self, rows: list[dict], columns: list[str] | None = None, title: str | None = None) -> None:
        from rich.table import Table
        from rich.text import Text
        cols = columns or list(rows[0].keys())
        t = Table(title=title)
        for c in cols:
            cells = [_cell(c, r.get(c)) for r in rows]
            if _is_id(c):      # ids are never cut: an operator copies them into the next command
                width = max([len(line) for x in cells for line in x.splitlines()] + [len(c)])
                t.add_column(c, no_wrap=True, min_width=width)
            else:
                t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*[Text(_cell(c, r.get(c))) for c in cols])
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


def _is_id(column: str) -> bool:
    return column in ("unit", "unit_id", "volumes", "members") or column.endswith("_id")


def _cell(column: str, v) -> str:
    from . import humanize as H
    if v is None or v == "":
        return "-"
    if isinstance(v, list):
        return "\n".join(map(str, v)) or "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_cell(k, x)}" for k, x in v.items())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if column.endswith("bytes") or column in ("bytes_on_wire", "bytes_changed"):
            return f"{H.size(v)} ({v})" if column == "capacity_bytes" else H.size(v)
        if column.endswith(("_seconds", "_s", "duration")):
            return H.duration(v)
        if column.endswith("_time") or column.endswith("_at"):
            return H.instant(v)
    return str(v)


def _config(path):
    """Load a site config; a missing or unreadable file is a usage error, said plainly."""
    from pathlib import Path

    from drsvc.config import load
    if not path:
        raise UsageError("give --config site.toml (or set DRSVC_CONFIG)")
    if not Path(path).is_file():
        raise UsageError(f"config file {path} does not exist")
    try:
        return load(path)
    except Exception as e:  # noqa: BLE001 - any parse problem is the caller's input
        msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        raise UsageError(f"config file {path}: {msg}") from None


def _endpoint(args) -> str:
    if args.endpoint:
        return args.endpoint
    if args.config:
        return _config(args.config).endpoint
    if os.environ.get("CSI_ENDPOINT"):
        return os.environ["CSI_ENDPOINT"]
    raise UsageError("give --endpoint, --config or set DRSVC_CONFIG / CSI_ENDPOINT")


def _unit(args, c=None) -> dict:
    """{"volume_id": ...} or {"group_id": ...}, a unique id prefix resolved when a client is given."""
    if bool(args.volume) == bool(args.group):
        raise UsageError("give exactly one of --volume or --group")
    if c is None:
        return {"volume_id": args.volume} if args.volume else {"group_id": args.group}
    return {"volume_id": resolve(c, "volume", args.volume)} if args.volume else \
        {"group_id": resolve(c, "group", args.group)}


def resolve(c, kind: str, text: str, *, must_exist: bool = False) -> str:
    """A whole id, or the one id that *text* is a prefix of (volumes and groups here, and the
    replication units this site holds). Ambiguous is a usage error; no match is not found when
    *must_exist*, otherwise the text is passed on for the plugin to answer."""
    known = set(v["volume_id"] for v in c.list_volumes()) if kind == "volume" else \
        set(g["group_id"] for g in c.list_groups())
    try:
        known |= {s["unit_id"] for s in c.statuses() if s["kind"] == kind}
    except Exception:  # noqa: BLE001 - status is a convenience here, not a requirement
        pass
    if text in known:
        return text
    matches = sorted(k for k in known if k.startswith(text))
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise UsageError(f"{kind} id prefix {text!r} is ambiguous: {', '.join(matches)}")
    if must_exist:
        raise NotFoundError(f"{kind} {text} does not exist at this site")
    return text


def _client(args):
    from .client import DrClient
    return DrClient(_endpoint(args), timeout=args.timeout)


# -- commands ---------------------------------------------------------------------------
def cmd_site(args, out: Output):
    from drsvc.sitectl import SiteRun
    run = SiteRun(_config(args.config))
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
    from . import humanize
    if args.action == "create":
        try:
            size = humanize.parse_size(args.size)
        except humanize.BadSize as e:
            raise UsageError(str(e)) from None
    with _client(args) as c:
        if args.action == "create":
            group = resolve(c, "group", args.group, must_exist=True) if args.group else ""
            return out.result("volume create", c.create_volume(args.name, size, fs_type=args.fs_type,
                                                                group_id=group))
        if args.action == "list":
            return out.result("volume list", c.list_volumes())
        vid = resolve(c, "volume", args.volume_id, must_exist=True)
        c.delete_volume(vid)
        return out.result("volume delete", {"volume_id": vid, "deleted": True})


def cmd_group(args, out: Output):
    with _client(args) as c:
        if args.action == "create":
            return out.result("group create", c.create_group(args.name))
        if args.action == "list":
            return out.result("group list", c.list_groups())
        gid = resolve(c, "group", args.group_id, must_exist=True)
        c.delete_group(gid)
        return out.result("group delete", {"group_id": gid, "deleted": True})


_RPC = {"enable": "EnableVolumeReplication", "disable": "DisableVolumeReplication",
        "promote": "PromoteVolume", "demote": "DemoteVolume"}


def cmd_replication(args, out: Output):
    _unit(args)
    with _client(args) as c:
        unit = _unit(args, c)
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
    _unit(args)
    with _client(args) as c:
        unit = _unit(args, c)
        deadline = time.monotonic() + (args.wait if args.wait_ready else 0)
        with out.progress("resync") as tick:
            while True:
                resp = c.until_done(lambda: c.replication("ResyncVolume", force=args.force, **unit), wait=60,
                                    progress=tick)
                if resp.ready or time.monotonic() > deadline:
                    break
                tick("waiting for the primary's next sync" if args.force else
                     "not consistent; a copy with writes the primary lacks needs --force")
                time.sleep(1)
        result = {"ready": resp.ready, **c.status(**unit)}
        out.result("resync", result)
        return EXIT_OK if resp.ready or not args.wait_ready else EXIT_RETRY


def cmd_sync_now(args, out: Output):
    _unit(args)
    with _client(args) as c:
        unit = _unit(args, c)
        with out.progress("sync") as tick:
            r = c.until_done(lambda: c.sync_now(**unit, wait=args.wait if args.wait_done else 1.0),
                             wait=args.wait if args.wait_done else 0, progress=tick)
        if r.get("skipped"):
            raise Refused(f"no sync: {r['skipped']}")
        return out.result("sync-now", r)


def cmd_status(args, out: Output):
    from .status_view import render
    single = bool(args.volume or args.group)
    with _client(args) as c:
        unit = _unit(args, c) if single else None

        def once():
            rows = [c.status(**unit)] if single else c.statuses()
            if out.json:   # one unit: its object; no unit: the list of all
                out.result("status", rows[0] if single else rows)
            else:
                render(out.console, rows)
        if not args.watch:
            once()
            return EXIT_OK
        # Ctrl-C only sets a flag: an interrupt inside a gRPC call could leave the channel
        # unable to close, so the refresh in progress finishes and the loop ends after it
        stop = []
        previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
        try:
            while not stop:
                if not out.json and out.console.is_terminal:
                    out.console.clear()
                once()
                sys.stdout.flush()
                deadline = time.monotonic() + args.every
                while not stop and time.monotonic() < deadline:
                    time.sleep(min(0.1, args.every))
        finally:
            signal.signal(signal.SIGINT, previous)
        return EXIT_OK


def cmd_clone(args, out: Output):
    _unit(args)
    with _client(args) as c:
        return out.result("clone", c.clone_replica(args.prefix, **_unit(args, c)))


TASK_COLUMNS = "name,args,kwargs,state,result,received,started,runtime,worker,uuid"


def cmd_flower(args, out: Output):
    """Celery Flower for this site's workers (task names and arguments; no secrets travel in tasks)."""
    from workers.app import make_app
    cfg = _config(args.config)
    app = make_app(cfg)
    os.environ.setdefault("DRSVC_CONFIG", str(cfg.path))
    argv = ["flower", f"--port={args.port}", f"--address={args.address}", "--persistent=False",
            f"--tasks_columns={TASK_COLUMNS}"]
    app.start(argv)
    return EXIT_OK


def cmd_worker(args, out: Output):
    from workers.main import worker_main
    _config(args.config)
    argv = ["--config", args.config, "--role", args.role, "--node", args.node]
    return worker_main(argv + (["--concurrency", str(args.concurrency)] if args.concurrency else []))


def cmd_scheduler(args, out: Output):
    from workers.scheduler import main
    _config(args.config)
    return main(["--config", args.config, "--node", args.node])


def cmd_metrics(args, out: Output):
    from workers.metrics import main
    _config(args.config)
    return main(["--config", args.config, "--address", args.address, "--node", args.node])


def cmd_demo(args, out: Output):
    from .demo import demo_down, run_demo
    if getattr(args, "action", None) == "down":
        if not args.root:
            raise UsageError("demo down needs --root DIR (printed by `drsvc demo --keep`)")
        return demo_down(args.root, as_json=args.json)
    return run_demo(keep=args.keep, as_json=args.json, root=args.root)


def build_parser() -> argparse.ArgumentParser:
    common = ArgParser(add_help=False)
    common.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"), help="site config (TOML)")
    common.add_argument("--endpoint", help="plugin socket, unix:///path (default: from --config)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--timeout", type=float, default=60.0, help="per-RPC timeout, seconds")
    unit = ArgParser(add_help=False)
    unit.add_argument("--volume", help="volume id (or a unique prefix of one)")
    unit.add_argument("--group", help="volume group id (or a unique prefix of one)")

    ap = ArgParser(prog="drsvc", description="drsvc disaster-recovery runbooks",
                   epilog="exit codes: 0 ok, 1 failure, 2 usage, 3 retryable, 4 refused, 5 not found")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("site", parents=[common], help="start/stop/inspect this site's processes")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(fn=cmd_site)
    for noun, fn in (("volume", cmd_volume), ("group", cmd_group)):
        p = sub.add_parser(noun, help=f"create, list, delete {noun}s")
        acts = p.add_subparsers(dest="action", required=True)
        q = acts.add_parser("create", parents=[common], help=f"create a {noun}")
        q.add_argument("name")
        if noun == "volume":
            q.add_argument("--size", default="1G", help="K/M/G/T or Ki/Mi/Gi/Ti (both 1024-based); default 1G")
            q.add_argument("--fs-type", default="ext4", choices=["ext4", "xfs"])
            q.add_argument("--group", help="join this volume group (id or unique prefix)")
        acts.add_parser("list", parents=[common], help=f"list {noun}s")
        q = acts.add_parser("delete", parents=[common], help=f"delete a {noun} (not found: exit 5)")
        q.add_argument(f"{noun}_id", metavar="ID", help="id or unique prefix")
        p.set_defaults(fn=fn)
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
    p = sub.add_parser("resync", parents=[common, unit],
                       help="check this copy against the primary; with --force discard divergence and follow it")
    p.add_argument("--force", action="store_true",
                   help="discard writes this site holds and the primary does not (ResyncVolume force)")
    p.add_argument("--wait", dest="wait_ready", action="store_true", help="wait until the copy is consistent")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=300)
    p.set_defaults(fn=cmd_resync)
    p = sub.add_parser("sync-now", parents=[common, unit], help="sync now instead of waiting for the schedule")
    p.add_argument("--wait", dest="wait_done", action="store_true", help="wait for the sync to finish")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=300)
    p.set_defaults(fn=cmd_sync_now)
    p = sub.add_parser("status", parents=[common, unit], help="replication status (UTC; whole ids)")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--every", type=float, default=2.0, help="seconds between refreshes with --watch")
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
        if name in ("worker", "scheduler", "metrics"):
            p.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""),
                           help="a multi-node site: this storage node's name in [nodes] (default: $DRSVC_NODE)")
        if name == "worker":
            p.add_argument("--role", choices=("data", "control", "api"), default="data",
                           help="data: syncs (and control when idle); control: only the control queue; "
                                "api: a storage node's calls from its site controller (needs --node)")
            p.add_argument("--concurrency", type=int, default=None, help="processes (api: threads); default 2 (api 8)")
        p.set_defaults(fn=fn)
    p = sub.add_parser("demo", parents=[common], help="the two-site DR demo on this host; `demo down` removes it")
    p.add_argument("--keep", action="store_true", help="leave the sites running afterwards")
    p.add_argument("--root", default=None, help="work directory (default: a new temp dir)")
    acts = p.add_subparsers(dest="action")
    q = acts.add_parser("down", parents=[common], help="stop and remove what `demo --keep` left running")
    q.add_argument("--root", default=None, help="the demo's work directory")
    p.set_defaults(fn=cmd_demo)
    return ap


def _command_of(argv) -> str:
    words = [w for w in argv if not w.startswith("-")]
    if len(words) > 1 and words[0] in ("volume", "group", "site", "demo"):
        return " ".join(words[:2])
    return words[0] if words else "drsvc"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return Output(as_json).error(_command_of(argv), e.code, e.message, e.exit_code)
    out = Output(getattr(args, "json", False) or as_json)
    command = args.command + (f" {args.action}" if getattr(args, "action", None) else "")
    from .client import RpcFailed
    try:
        return args.fn(args, out)
    except CliError as e:
        return out.error(command, e.code, e.message, e.exit_code)
    except RpcFailed as e:
        return out.error(command, e.code.name, e.message, _EXIT_BY_CODE.get(e.code, EXIT_FAIL))
    except Exception as e:  # noqa: BLE001 - a runbook gets a message and a code, not a traceback
        from drsvc.errors import DrsvcError
        msg = e.message if isinstance(e, DrsvcError) else f"{type(e).__name__}: {e}"
        return out.error(command, type(e).__name__, msg, EXIT_FAIL)


if __name__ == "__main__":
    raise SystemExit(main())
