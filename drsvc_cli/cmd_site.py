"""`drsvc site up|down|status`: this site's processes, their pids and where each one logs."""
from __future__ import annotations

import time

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
        caps = bandwidth_rows(run.cfg)
        if out.json:
            return out.result("site status", {"site": site, "components": rows, "run_dir": str(run.run_dir),
                                              "bandwidth": caps})
        out.table(rows, title=f"site {site} (logs and pid files in {run.run_dir})")
        if caps:
            out.table([_human_cap(c) for c in caps], title=f"bandwidth caps (times in {run.cfg.timezone})")
        return 0
    moved = sorted(c for c in status if (before[c] is None) != (status[c] is None))
    verb = "started" if args.action == "up" else "stopped"
    line = (f"site {site}: {verb} {', '.join(moved)}" if moved else
            f"site {site}: every process was {'running' if args.action == 'up' else 'stopped'} already; "
            "nothing changed") + f" (logs in {run.run_dir})"
    return out.change(f"site {args.action}", site, bool(moved), line,
                      {"site": site, "components": rows, "run_dir": str(run.run_dir)},
                      table=(rows, ["component", "pid", "running", "log"]))


def bandwidth_rows(cfg, now: float | None = None) -> list[dict]:
    """Each cap of the site (the site's bwlimit, each peer's): the rate in force now, the
    schedule entry that sets it, and the next change (bytes per second; 0: no cap)."""
    from drsvc.config import schedule_of
    t = time.time() if now is None else now
    holders = [("site", cfg)] + [(f"peer:{name}", p) for name, p in sorted(cfg.peers.items())]
    rows = []
    for name, holder in holders:
        sch = schedule_of(holder)
        if sch is not None:
            rows.append({"cap": name, **sch.describe(t)})
    return rows


def _human_cap(row: dict) -> dict:
    from .humanize import rate
    nxt = f"{rate(row['next_rate']) if row['next_rate'] else 'no cap'} at {row['next_change']}" \
        if "next_change" in row else "none"
    return {"cap": row["cap"], "now": rate(row["rate"]) if row["rate"] else "no cap", "entry": row["entry"],
            "next change": nxt}


def add_parsers(sub, common) -> None:
    p = sub.add_parser("site", parents=[common], help="start/stop/inspect this site's processes (and their logs)")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(fn=cmd_site)
