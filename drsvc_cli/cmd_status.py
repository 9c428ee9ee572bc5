"""`drsvc status`: the operator's view of replication (drsvc_cli/status_view.py prints it)."""
from __future__ import annotations

import signal
import sys
import time

from .cmd_replication import group_of_member
from .context import client, unit as resolve_unit
from .errors import EXIT_OK


def _target(c, args) -> tuple[dict | None, str]:
    """The unit to show (None: all) and, for a volume that replicates as a member of its
    group, that volume: the group's status is shown with the member's line marked."""
    if not (args.volume or args.group):
        return None, ""
    unit = resolve_unit(args, c)
    if gid := group_of_member(c, unit):
        return {"group_id": gid}, unit["volume_id"]
    return unit, ""


def cmd_status(args, out):
    from .status_view import render
    with client(args) as c:
        unit, member = _target(c, args)

        def once():
            if not unit and args.limit:
                return _one_page(c, args, out)
            rows = [c.status(**unit)] if unit else c.statuses()
            if out.json:   # one unit: its object (a member: its group's, with "member"); no unit: all
                out.result("status", ({**rows[0], "member": member} if member else rows[0]) if unit else rows)
                return
            if member:
                out.console.print(f"{member} is a member of {unit['group_id']}: it replicates with its group "
                                  f"(act on it with --group {unit['group_id']})", soft_wrap=True)
            render(out.console, rows, member=member)
        if not args.watch:
            once()
            return EXIT_OK
        watch(once, out, args.every)
        return EXIT_OK


def _one_page(c, args, out) -> None:
    """--limit N: N units from --continue's token on, and the token of the next page."""
    from .status_view import render
    rows, token = c.status_page(args.limit, args.continue_token)
    if out.json:
        out.result("status", rows, next_token=token)
        return
    render(out.console, rows)
    if token:
        out.console.print(f"more: drsvc status --limit {args.limit} --continue {token}", soft_wrap=True)


def watch(once, out, every: float) -> None:
    """Refresh until Ctrl-C. Ctrl-C only sets a flag: an interrupt inside a gRPC call could
    leave the channel unable to close, so the refresh in progress finishes and the loop ends."""
    stop = []
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        while not stop:
            if not out.json and out.console.is_terminal:
                out.console.clear()
            once()
            sys.stdout.flush()
            deadline = time.monotonic() + every
            while not stop and time.monotonic() < deadline:
                time.sleep(min(0.1, every))
    finally:
        signal.signal(signal.SIGINT, previous)


def add_parsers(sub, common, unit_args) -> None:
    p = sub.add_parser("status", parents=[common, unit_args], help="replication status (UTC; whole ids)")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--every", type=float, default=2.0, help="seconds between refreshes with --watch")
    p.add_argument("--limit", type=int, default=0,
                   help="all units: show at most this many (id order), and the token of the next page")
    p.add_argument("--continue", dest="continue_token", default="", metavar="TOKEN",
                   help="with --limit: the page after the one that printed this token")
    p.set_defaults(fn=cmd_status)
