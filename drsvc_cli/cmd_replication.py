"""enable, disable, promote, demote, resync, sync-now and clone: each says what changed, and where."""
from __future__ import annotations

import time

import grpc

from . import changes
from .client import RpcFailed
from .context import client, unit as resolve_unit
from .errors import EXIT_OK, EXIT_RETRY, Refused
from .site_promote import PARALLEL

_RPC = {"enable": "EnableVolumeReplication", "disable": "DisableVolumeReplication",
        "promote": "PromoteVolume", "demote": "DemoteVolume"}


def status_or_none(c, unit: dict) -> dict | None:
    """The unit's status; None when replication is not enabled for it here."""
    try:
        return c.status(**unit)
    except RpcFailed as e:
        if e.code == grpc.StatusCode.NOT_FOUND and "not enabled" in e.message:
            return None
        raise


def group_of_member(c, unit: dict) -> str:
    """The replicated group *unit*'s volume replicates with ("" when it is not such a member)."""
    vid = unit.get("volume_id")
    if not vid or status_or_none(c, unit) is not None:
        return ""
    gid = next((v["group_id"] for v in c.list_volumes() if v["volume_id"] == vid), "")
    return gid if gid and status_or_none(c, {"group_id": gid}) is not None else ""


def refuse_member(c, unit: dict) -> None:
    if gid := group_of_member(c, unit):
        raise Refused(f"{unit['volume_id']} is a member of {gid}; use --group {gid} "
                      "(a member replicates, fails over and resyncs with its group)")


def _call(args, out, c, unit: dict, **fields):
    with out.progress(f"{args.command} {changes.name(unit)}") as tick:
        return c.until_done(lambda: c.replication(_RPC[args.command], **unit, **fields), wait=args.wait,
                            progress=tick)


def cmd_enable(args, out):
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        params = {"schedulingInterval": args.interval}
        if args.peer:
            params["peer"] = args.peer
        if args.start_time:
            params["schedulingStartTime"] = args.start_time
        before = status_or_none(c, unit)
        _call(args, out, c, unit, parameters=params)
        after = c.status(**unit)
        changed, line = changes.enable_line(site, changes.name(unit), before, after)
        return out.change("enable", site, changed, line, after)


def cmd_disable(args, out):
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        refuse_member(c, unit)        # the API answers OK there (a VR must finalize); an operator is told
        before = status_or_none(c, unit)
        _call(args, out, c, unit)
        changed, line = changes.disable_line(site, changes.name(unit), before)
        return out.change("disable", site, changed, line, {**unit, "enabled": False, "before": before})


def cmd_role(args, out):
    """promote and demote."""
    if getattr(args, "all", False):
        from .site_promote import cmd_demote_all, cmd_promote_all
        return (cmd_promote_all if args.command == "promote" else cmd_demote_all)(args, out)
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        before = status_or_none(c, unit)
        fields = {"force": args.force} if args.command == "promote" else {}
        if args.command == "promote" and args.point:
            fields["parameters"] = {"drsvc.io/recoveryPoint": args.point}     # take over at a recovery point
        _call(args, out, c, unit, **fields)
        after = c.status(**unit)
        role, verb = ("primary", "promoted") if args.command == "promote" else ("secondary", "demoted")
        if before is None:          # refused by the plugin before this point; kept for a race with disable
            before = after
        changed, line = changes.role_line(site, changes.name(unit), verb, role, before, after)
        return out.change(args.command, site, changed, line, {**after, "before": changes.state(before) and {
            "role": before["role"], "epoch": before["epoch"]}})


def cmd_resync(args, out):
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        before = status_or_none(c, unit)
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
        changed, line = changes.resync_line(site, changes.name(unit), resp.ready, before, args.force)
        out.change("resync", site, changed, line, {"ready": resp.ready, **c.status(**unit)})
        return EXIT_OK if resp.ready or not args.wait_ready else EXIT_RETRY


def cmd_sync_now(args, out):
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        with out.progress("sync") as tick:
            r = c.until_done(lambda: c.sync_now(**unit, wait=args.wait if args.wait_done else 1.0),
                             wait=args.wait if args.wait_done else 0, progress=tick)
        if r.get("skipped"):
            raise Refused(f"no sync: {r['skipped']}")
        changed, line = changes.sync_line(site, changes.name(unit), r)
        return out.change("sync-now", site, changed, line, {**unit, **r})


def cmd_clone(args, out):
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        r = c.clone_replica(args.prefix, point=args.point or "", force=args.force, **unit)
        sources = c.status(**unit)["members"] or [changes.name(unit)]     # the clones' order
        rows = [{"source": s, "clone": v["volume_id"], "size": v["capacity_bytes"]}
                for s, v in zip(sources, r["volumes"], strict=False)]
        line = (f"site {site}: {len(rows)} clone(s) of {changes.name(unit)} at generation {r['generation']}, "
                "read-write (delete them with `drsvc volume delete ID`)")
        return out.change("clone", site, True, line, {**unit, **r, "clones": rows},
                          table=(rows, ["source", "clone", "size"]))


def add_parsers(sub, common, unit_args) -> None:
    for name, helptext, fn in (("enable", "enable replication", cmd_enable),
                               ("disable", "end replication on both sides", cmd_disable),
                               ("promote", "make this site primary", cmd_role),
                               ("demote", "make this site secondary", cmd_role)):
        p = sub.add_parser(name, parents=[common, unit_args], help=helptext)
        p.add_argument("--wait", type=float, default=120, help="keep retrying an in-progress answer this long")
        if name == "enable":
            p.add_argument("--interval", default="5m")
            p.add_argument("--peer")
            p.add_argument("--start-time")
        if name == "promote":
            p.add_argument("--force", action="store_true", help="promote with the peer unreachable (fences it)")
            p.add_argument("--point", help="take over at this recovery point: a generation, or an RFC 3339 time "
                                           "(the newest point at or before it); see `drsvc points`")
            p.add_argument("--all", action="store_true",
                           help="every unit this site holds as secondary, concurrently (a site failover)")
            p.add_argument("--dry-run", action="store_true", help="with --all: list what would be promoted")
            p.add_argument("--parallel", type=int, default=PARALLEL, help="with --all: promotes in flight at once")
        if name == "demote":
            p.add_argument("--all", action="store_true",
                           help="every unit this site holds as primary, in one batch per node (a site's failback)")
            p.add_argument("--resync", action="store_true",
                           help="with --all: then discard what diverged and follow the peer (resync --force)")
            p.add_argument("--dry-run", action="store_true", help="with --all: list what would be demoted")
        p.set_defaults(fn=fn, needs_unit=True)
    p = sub.add_parser("resync", parents=[common, unit_args],
                       help="check this copy against the primary; with --force discard divergence and follow it")
    p.add_argument("--force", action="store_true",
                   help="discard writes this site holds and the primary does not (ResyncVolume force)")
    p.add_argument("--wait", dest="wait_ready", action="store_true", help="wait until the copy is consistent")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=300)
    p.set_defaults(fn=cmd_resync, needs_unit=True)
    p = sub.add_parser("sync-now", parents=[common, unit_args], help="sync now instead of waiting for the schedule")
    p.add_argument("--wait", dest="wait_done", action="store_true", help="wait for the sync to finish")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=300)
    p.set_defaults(fn=cmd_sync_now, needs_unit=True)
    p = sub.add_parser("clone", parents=[common, unit_args], help="clone the latest replicated generation (drills)")
    p.add_argument("--prefix", default="drill")
    p.add_argument("--point", help="clone this recovery point instead: a generation or an RFC 3339 time")
    p.add_argument("--force", action="store_true", help="clone even a copy or point its verify found damaged")
    p.set_defaults(fn=cmd_clone, needs_unit=True)
