"""`drsvc promote --all`: take over every unit this site holds as a secondary, the way a DR
runbook does when the primary site is lost.

The site's Site service (``PromoteAll``: a one-node site's plugin, a multi-node site's
controller) promotes the units (volumes and groups; a group's members go with it) in one
batch per storage node, each as its own PromoteVolume would be: a unit is never promoted
twice, a unit already primary is not listed, and a second run after an interrupted one takes
only what is left. `--dry-run` lists what would be promoted, with each copy's data age, and
changes nothing. A plugin without the Site service (an older release) is driven unit by unit
instead: PromoteVolume calls, --parallel at a time, each retried while it answers ABORTED.

`drsvc demote --all` is its counterpart at the site that comes back (``DemoteAll``): every
unit held here as primary is demoted in one batch per node, each as its own DemoteVolume
would be, and with `--resync` then resynced with force, so the peer's next sync (asked for
now) ships what diverged. It needs the Site service's DemoteAll (this release's plugins).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from .client import RpcFailed
from .context import client

COLUMNS = ["unit_id", "kind", "peer", "generation", "data_age_seconds"]

PARALLEL = 16      # promotes in flight at once: the site's control workers take them in turn


def secondary_units(c) -> list[dict]:
    """Every unit this site holds as secondary, with what a runbook shows of it."""
    rows = []
    for s in c.statuses():
        if s["role"] != "secondary":
            continue
        rows.append({"unit_id": s["unit_id"], "kind": s["kind"], "peer": s.get("peer", ""),
                     "generation": s.get("generation", 0), "data_age_seconds": s.get("lag_seconds", 0.0)})
    return sorted(rows, key=lambda r: r["unit_id"])


def promote_unit(c, row: dict, *, force: bool, wait: float) -> dict:
    field = "group_id" if row["kind"] == "group" else "volume_id"
    t0 = time.monotonic()
    try:
        c.until_done(lambda: c.replication("PromoteVolume", force=force, **{field: row["unit_id"]}), wait=wait)
        return {**row, "result": "promoted", "seconds": round(time.monotonic() - t0, 3)}
    except RpcFailed as e:
        return {**row, "result": "failed", "code": e.code.name, "message": e.message,
                "seconds": round(time.monotonic() - t0, 3)}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(done: list[dict], seconds: float) -> dict:
    times = [r["seconds"] for r in done if r["result"] == "promoted"]
    failed = sum(1 for r in done if r["result"] == "failed")
    return {"units": len(done), "promoted": len(times), "failed": failed, "seconds": round(seconds, 3),
            "promote_p50_seconds": _percentile(times, 0.5), "promote_p99_seconds": _percentile(times, 0.99),
            "results": done}


def promote_all(c, plan: list[dict], *, force: bool, wait: float, parallel: int = PARALLEL) -> dict:
    """Promote every unit of *plan* concurrently, a PromoteVolume each; the per-unit
    results and a summary."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        done = list(pool.map(lambda r: promote_unit(c, r, force=force, wait=wait), plan))
    return summarize(done, time.monotonic() - t0)


def take_over(c, *, force: bool, dry_run: bool, wait: float, parallel: int = PARALLEL, progress=None) -> dict:
    """A site failover at *c*'s endpoint: ``{"plan": rows}`` with *dry_run*, else the
    summary of ``summarize``. The Site service's one call where the plugin has it, else
    PromoteVolume unit by unit (*progress*: a context manager shown meanwhile)."""
    t0 = time.monotonic()
    try:
        # ABORTED: another batch of this site's still runs (an earlier, interrupted call)
        rows, _server_s = c.until_done(lambda: c.promote_all(force=force, dry_run=dry_run), wait=wait)
        return {"plan": [{k: r[k] for k in COLUMNS} for r in rows]} if dry_run \
            else summarize(rows, time.monotonic() - t0)
    except RpcFailed as e:
        if e.code != grpc.StatusCode.UNIMPLEMENTED:
            raise
    plan = secondary_units(c)
    if dry_run:
        return {"plan": plan}
    with progress(f"promote --all ({len(plan)} units)") if progress else contextlib.nullcontext():
        return promote_all(c, plan, force=force, wait=wait, parallel=parallel)


def cmd_promote_all(args, out) -> int:
    with client(args) as c:
        site = c.site()
        answer = take_over(c, force=args.force, dry_run=args.dry_run, wait=args.wait, parallel=args.parallel,
                           progress=out.progress)
    if args.dry_run:
        plan = answer["plan"]
        line = (f"site {site}: would promote {len(plan)} unit(s) held here as secondary"
                + (" with force" if args.force else "") + "; nothing changed (--dry-run)")
        return out.change("promote --all", site, False, line, {"dry_run": True, "units": plan},
                          table=(plan, COLUMNS) if plan else None)
    summary = answer
    failed = [r for r in summary["results"] if r["result"] == "failed"]
    line = (f"site {site}: promoted {summary['promoted']} of {summary['units']} unit(s)"
            + (" with force" if args.force else "") + f" in {summary['seconds']:.1f}s (one promote: "
            f"p50 {summary['promote_p50_seconds']:.2f}s, p99 {summary['promote_p99_seconds']:.2f}s)"
            + (f"; {len(failed)} failed: run it again to retry them" if failed else ""))
    rc = out.change("promote --all", site, bool(summary["promoted"]), line, summary,
                    table=(failed, ["unit_id", "kind", "code", "message"]) if failed else None)
    return rc if not failed else 1


DEMOTE_COLUMNS = ["unit_id", "kind", "peer", "generation"]


def hand_back(c, *, resync: bool, dry_run: bool, wait: float) -> dict:
    """A site's failback at *c*'s endpoint, one DemoteAll: ``{"plan": rows}`` with *dry_run*,
    else a summary of the per-unit results (their ``failed`` ones listed apart)."""
    t0 = time.monotonic()
    # ABORTED: another batch of this site's still runs (an earlier, interrupted call)
    rows, _server_s = c.until_done(lambda: c.demote_all(resync=resync, dry_run=dry_run), wait=wait)
    if dry_run:
        return {"plan": [{k: r[k] for k in DEMOTE_COLUMNS} for r in rows]}
    failed = [r for r in rows if r["result"] == "failed" or r["resync"] == "failed"]
    demoted = [r for r in rows if r["result"] == "demoted"]
    times = [r["seconds"] for r in demoted]
    return {"units": len(rows), "demoted": len(demoted), "failed": len(failed),
            "seconds": round(time.monotonic() - t0, 3),
            "demote_p50_seconds": _percentile(times, 0.5), "demote_p99_seconds": _percentile(times, 0.99),
            "without_final_sync": sum(1 for r in demoted if not r["final_sync"]),
            "resync_requested": sum(1 for r in rows if r["resync"] == "requested"),
            "resync_ready": sum(1 for r in rows if r["resync"] == "ready"), "results": rows,
            "failed_units": failed}


def cmd_demote_all(args, out) -> int:
    with client(args) as c:
        site = c.site()
        answer = hand_back(c, resync=args.resync, dry_run=args.dry_run, wait=args.wait)
    if args.dry_run:
        plan = answer["plan"]
        line = (f"site {site}: would demote {len(plan)} unit(s) held here as primary"
                + (" and resync them" if args.resync else "") + "; nothing changed (--dry-run)")
        return out.change("demote --all", site, False, line, {"dry_run": True, "units": plan},
                          table=(plan, DEMOTE_COLUMNS) if plan else None)
    failed = answer.pop("failed_units")
    summary = answer
    line = (f"site {site}: demoted {summary['demoted']} of {summary['units']} unit(s) in {summary['seconds']:.1f}s"
            + (f", {summary['without_final_sync']} without a final sync (diverged)" if summary["without_final_sync"] else "")
            + (f"; resync: {summary['resync_ready']} ready, {summary['resync_requested']} asked of the peer "
               "(watch drsvc status)" if args.resync else "")
            + (f"; {len(failed)} failed: run it again to retry them" if failed else ""))
    rc = out.change("demote --all", site, bool(summary["demoted"] or summary["resync_requested"]), line, summary,
                    table=(failed, ["unit_id", "kind", "result", "resync", "code", "message"]) if failed else None)
    return rc if not failed else 1
