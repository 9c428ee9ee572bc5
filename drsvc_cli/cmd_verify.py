"""`drsvc verify`: read the replica held at this site and check its blocks (a scrub).

Exit codes: 0 clean; 1 mismatches found (``--repair`` asks the primary to re-send the
replica's; a recovery point's damage cannot be repaired, only reported);
3 incomplete (the unit changed under the verify, or nothing could be compared: run it again);
the usual codes otherwise (4 at a primary: verify where the copy is held).
"""
from __future__ import annotations

from . import changes
from . import humanize as H
from .context import client, unit as resolve_unit
from .errors import EXIT_FAIL, EXIT_OK, EXIT_RETRY
from .cmd_replication import refuse_member

EXIT_BY_RESULT = {"clean": EXIT_OK, "mismatch": EXIT_FAIL, "incomplete": EXIT_RETRY}


def summary(site: str, name: str, r: dict) -> str:
    against = " and ".join(w for w, on in (("the receiver's block map", r["checked"]["recorded"]),
                                           ("the primary's snapshot", r["checked"]["primary"])) if on) or "nothing"
    head = (f"site {site}: verify of {name} at generation {r['generation']}: {r['result']}, "
            f"{H.size(r['bytes_read'])} read in {H.duration(r['duration_seconds'])}, against {against}")
    if r["mismatched_blocks"]:
        head += (f"; {r['mismatched_blocks']} block(s) differ; "
                 + ("repair asked for: the primary's next sync re-sends them" if r["repair_requested"]
                    else "`drsvc verify --repair` re-sends them from the primary"))
    if r.get("damaged_points"):
        head += (f"; recovery point(s) {', '.join(map(str, r['damaged_points']))} damaged "
                 f"({r['point_bad_blocks']} block(s)): the primary keeps no older generations, so they cannot "
                 "be repaired; a promote to them is refused unless forced")
    if r.get("unverifiable_points"):
        head += f"; point(s) {', '.join(map(str, r['unverifiable_points']))} unverifiable (no digests)"
    return head + "".join(f"\n  note: {n}" for n in r["notes"])


def cmd_verify(args, out):
    with client(args) as c:
        unit, site = resolve_unit(args, c), c.site()
        refuse_member(c, unit)
        with out.progress("verify") as tick:
            r = c.until_done(lambda: c.verify(**unit, repair=args.repair, wait=args.wait), wait=args.wait,
                             progress=tick)
    code = EXIT_BY_RESULT.get(r["result"], EXIT_FAIL)
    result = {**unit, **r, "site": site}
    if out.json:
        return out.finding("verify", result, code, "VERIFY_FAILED" if r["result"] == "mismatch" else "INCOMPLETE",
                           summary(site, changes.name(unit), r))
    out.console.print(summary(site, changes.name(unit), r), soft_wrap=True, markup=False)
    if r["mismatches"]:
        out.table([{"point": "-", **m} for m in r["mismatches"]],
                  ["volume_id", "offset", "length", "against", "generation", "point"],
                  title="the first mismatched ranges (offset and length in bytes)")
    return code


def add_parsers(sub, common, unit_args) -> None:
    p = sub.add_parser("verify", parents=[common, unit_args],
                       help="read this site's replica and check its blocks against what was applied and the primary")
    p.add_argument("--repair", action="store_true",
                   help="mismatched blocks are re-sent from the primary (its next sync, a compare sync)")
    p.add_argument("--timeout-wait", dest="wait", type=float, default=3600,
                   help="wait this long for the verify (it reads the whole replica)")
    p.set_defaults(fn=cmd_verify, needs_unit=True)
