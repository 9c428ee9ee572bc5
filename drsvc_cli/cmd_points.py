"""`drsvc points`: the recovery points a unit keeps at this site."""
from __future__ import annotations

from . import humanize as H
from .context import client, unit as resolve_unit
from .errors import EXIT_OK


def cmd_points(args, out):
    """The unit's points, oldest first; --json: the list, each point with exactly
    generation, time, kind, pinned, unique_bytes and total_bytes."""
    with client(args) as c:
        r = c.recovery_points(**resolve_unit(args, c), limit=args.limit, token=args.continue_token)
    if out.json:
        return out.result("points", r["points"], **({"next_token": r["next_token"]} if args.limit else {}))
    if r["points"]:
        out.table(r["points"], title="recovery points, oldest first (time: the origin's capture instant, UTC)")
    else:
        out.console.print("no recovery points at this site")
    out.console.print(f"replica {H.size(r['replica_bytes'])} + points {H.size(r['points_bytes'])} = "
                      f"{H.size(r['replica_bytes'] + r['points_bytes'])} at this site; "
                      f"retention {r['retention'] or '-'}", soft_wrap=True)
    if r["next_token"]:
        out.console.print(f"more: drsvc points {_unit_args(args)} --limit {args.limit} --continue {r['next_token']}",
                          soft_wrap=True)
    return EXIT_OK


def _unit_args(args) -> str:
    return f"--group {args.group}" if args.group else f"--volume {args.volume}"


def add_parsers(sub, common, unit_args) -> None:
    p = sub.add_parser("points", parents=[common, unit_args], help="the recovery points kept at this site")
    p.add_argument("--limit", type=int, default=0,
                   help="show at most this many points (oldest first), and the token of the next page")
    p.add_argument("--continue", dest="continue_token", default="", metavar="TOKEN",
                   help="with --limit: the page after the one that printed this token")
    p.set_defaults(fn=cmd_points, needs_unit=True)
