"""`drsvc site up|down|status`: this site's processes, their pids and where each one logs."""
from __future__ import annotations

from .context import config_path, load_config


def cmd_site(args, out):
    from drsvc.sitectl import SiteRun
    run = SiteRun(load_config(config_path(args)))
    before = run.status()
    if args.action == "up":
        run.up()
    elif args.action == "down":
        run.down()
    status = run.status()
    rows = [{"component": c, "pid": pid, "running": pid is not None, "log": str(run.log_file(c))}
            for c, pid in status.items()]
    site = run.cfg.site
    if args.action == "status":
        if out.json:
            return out.result("site status", {"site": site, "components": rows, "run_dir": str(run.run_dir)})
        out.table(rows, title=f"site {site} (logs and pid files in {run.run_dir})")
        return 0
    moved = sorted(c for c in status if (before[c] is None) != (status[c] is None))
    verb = "started" if args.action == "up" else "stopped"
    line = (f"site {site}: {verb} {', '.join(moved)}" if moved else
            f"site {site}: every process was {'running' if args.action == 'up' else 'stopped'} already; "
            "nothing changed") + f" (logs in {run.run_dir})"
    return out.change(f"site {args.action}", site, bool(moved), line,
                      {"site": site, "components": rows, "run_dir": str(run.run_dir)},
                      table=(rows, ["component", "pid", "running", "log"]))


def add_parsers(sub, common) -> None:
    p = sub.add_parser("site", parents=[common], help="start/stop/inspect this site's processes (and their logs)")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(fn=cmd_site)
