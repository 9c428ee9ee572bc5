"""`drsvc status` for an operator: whole ids, human sizes and durations, UTC, next sync, progress.

Wide consoles get one table; narrow ones (80 columns, or piped) one block per unit, so an id
is never cut. On a secondary, "lag" is the data age and "last sync" the last generation received.
"""
from __future__ import annotations

import time

from . import humanize as H

WIDE = 150
HEALTH_STYLE = {"HEALTHY": "green", "DEGRADED": "yellow", "ERROR": "red", "UNKNOWN": "dim",
                "VERIFY_FAILED": "bold red"}


def _verified(r, now) -> str:
    v = r.get("verify")
    if not v:
        return "-"
    every = f"every {H.duration(v['interval_seconds'])}" if v["interval_seconds"] else "not scheduled"
    last = H.instant(v["last_time"], now) if v["last_time"] else "never"
    bad = f"; FAILED: {v['mismatched_blocks']} block(s) of generation {v['generation']} differ" \
        if v["failed"] and v["mismatched_blocks"] else ""
    if v.get("damaged_points"):
        bad += f"; FAILED: {v['damaged_points']} recovery point(s) damaged"
    return f"last {last} ({every}){bad}"


def _progress(r) -> str:
    p = r.get("progress")
    if not p:
        return "-"
    pct = f" ({100 * p['bytes_sent'] / p['bytes_planned']:.0f}%)" if p["bytes_planned"] else ""
    return f"sending {H.size(p['bytes_sent'])} of {H.size(p['bytes_planned'])} changed{pct}, {H.rate(p['rate_bps'])}"


def _next(r, now) -> str:
    if r["role"] != "primary":
        return "- (secondary: the primary schedules)"
    ts = r.get("next_sync_time")
    if not ts:
        return "not scheduled here"
    if ts < now - 5:
        return f"{H.instant(ts, now)}, overdue: is the scheduler running?"
    return H.instant(ts, now)


def rows(statuses, now: float | None = None) -> list[dict]:
    now = time.time() if now is None else now
    out = []
    for r in statuses:
        sec = r["role"] == "secondary"
        out.append({
            "unit": r["unit_id"], "kind": r["kind"], "role": r["role"], "health": r["status"],
            "peer": r["peer"], "epoch": r["epoch"], "generation": r["generation"],
            "lag": ("data age " if sec else "lag ") + H.duration(r["lag_seconds"])
                   + f" (interval {H.duration(r['interval_seconds'])})",
            "last": H.instant(r["last_sync_time"], now),
            "transfer": (f"{H.size(r['last_sync_bytes'])} in {H.duration(r['last_sync_duration'])}"
                         if r["last_sync_time"] else "-"),
            "next": _next(r, now), "progress": _progress(r), "message": r["status_message"],
            "verified": _verified(r, now),
            "short": {"lag": ("age " if sec else "") + f"{H.duration(r['lag_seconds'])} / {H.duration(r['interval_seconds'])}",
                      "last": H.short_instant(r["last_sync_time"], now),
                      "transfer": (f"{H.size(r['last_sync_bytes'])}, {H.duration(r['last_sync_duration'])}"
                                   if r["last_sync_time"] else "-"),
                      "next": "-" if sec else (H.short_instant(r.get("next_sync_time"), now)
                                               if r.get("next_sync_time") else "not scheduled")},
            "members": r.get("members") or [],
        })
    return out


MEMBER_MARK = "  <- this volume"


def render(console, statuses, now: float | None = None, member: str = "") -> None:
    """*member*: a volume whose group's status this is; its line is marked."""
    from rich.table import Table
    from rich.text import Text
    view = rows(statuses, now)
    for v in view:
        v["members"] = [m + MEMBER_MARK if m == member else m for m in v["members"]]
    stamp = H.instant(time.time() if now is None else now)
    if not view:
        console.print(f"no replicated volumes or groups (as of {stamp})")
        return
    if console.width >= WIDE:
        t = Table(title=f"replication at {stamp}", expand=False)
        idw = max(len(i) for v in view for i in [v["unit"], *v["members"]])
        t.add_column("unit", no_wrap=True, min_width=idw, overflow="fold")
        for c in ("role", "health", "lag / every", "last sync (UTC)", "sent, took", "next (UTC)"):
            t.add_column(c, no_wrap=True)
        t.add_column("message", overflow="fold", min_width=16)
        for v in view:
            unit = Text(v["unit"])
            if v["kind"] == "group":
                unit.append("".join(f"\n{m}" for m in v["members"]), style="dim")
            message = v["message"] if v["progress"] == "-" else f"{v['progress']}\n{v['message']}"
            t.add_row(unit, f"{v['role']}\n{v['kind']}",
                      Text(v["health"], style=HEALTH_STYLE.get(v["health"], "")),
                      v["short"]["lag"], v["short"]["last"], v["short"]["transfer"], v["short"]["next"], message)
        console.print(t)
        return
    console.print(f"replication at {stamp}")
    for v in view:
        t = Table(show_header=False, box=None, pad_edge=False, expand=False)
        t.add_column("k", style="bold", no_wrap=True)
        t.add_column("v", overflow="fold")
        t.add_row("unit", Text(v["unit"], no_wrap=True))
        t.add_row("health", Text(v["health"], style=HEALTH_STYLE.get(v["health"], "")))
        t.add_row("role", f"{v['role']} {v['kind']}, peer {v['peer']}, epoch {v['epoch']}, "
                          f"generation {v['generation']}")
        if v["kind"] == "group":
            t.add_row("members", Text("\n".join(v["members"])))
        t.add_row("lag" if v["role"] == "primary" else "data age", v["lag"].split(" ", 1)[1]
                  if v["role"] == "primary" else v["lag"].split(" ", 2)[2])
        t.add_row("last sync" if v["role"] == "primary" else "last received", v["last"])
        t.add_row("transfer", v["transfer"])
        t.add_row("next sync", v["next"])
        if v["role"] == "secondary":
            t.add_row("verified", v["verified"])
        if v["progress"] != "-":
            t.add_row("running", v["progress"])
        t.add_row("message", v["message"])
        console.print()
        console.print(t)
