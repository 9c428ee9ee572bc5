"""Case `aged`: 1% syncs of an image aged by many rounds of 1% rewrites, each synced.

Real volumes age: every round of random rewrites fragments the image further
(its extent count is reported). A capture or plan whose cost grows with the
extent count instead of with the change shows here: the capture and plan times
of the first aging round are reported beside those of the last, then the case
is timed like `1pct` (cold, floor, rsync beside).
"""
from __future__ import annotations

from . import ceilings
from .floor import coalesce
from .harness import GiB, RSYNC_DELTA, CaseResult, Run, extent_count, measure, rewrite_blocks, run_rsync
from .harness import same_content, write_random

ROUND_PHASES = ("capture_s", "plan_s", "freeze_s", "prepare_s", "stream_s")


def aged_case(ctx) -> CaseResult:
    from .worker import case_worker
    args = ctx.args
    res = CaseResult("aged", ctx.is_cold)
    unit = "aged"
    img = ctx.image(unit)
    write_random(img, int(args.size_gib * GiB), ctx.rnd)
    rounds = []
    with case_worker(ctx, res) as w:
        w.sync(ctx.a, unit)                                   # the initial copy (untimed)
        extents = {"start": extent_count(img)}
        for _ in range(args.aged_rounds):                    # aging (untimed, caches as left)
            rewrite_blocks(img, 0.01, ctx.rnd)
            out = w.sync(ctx.a, unit)
            ph = out["report"]["phases"]
            rounds.append({"wall_s": round(out["wall_s"], 4),
                           **{k: round(ph.get(k, 0.0), 4) for k in ROUND_PHASES}})
        extents["aged"] = extent_count(img)
        if not args.no_rsync:                                 # rsync's copy catches up (untimed)
            run_rsync(ctx.site, img, ctx.rsync_dest(img), ["--whole-file", "--inplace"])

        def change(i):
            offs = rewrite_blocks(img, 0.01, ctx.rnd)
            return Run(len(offs) * 4096, [(img, coalesce(offs))])
        measure(res, args.repeat, make_cold=ctx.cold, change=change, drsvc=lambda i: w.sync(ctx.a, unit),
                rsync=None if args.no_rsync else
                lambda i: run_rsync(ctx.site, img, ctx.rsync_dest(img), RSYNC_DELTA))
    res.extra["extent_costs"] = ceilings.extent_costs(img, res.phases, res.ranges_cloned)
    res.verified = same_content(img, ctx.replica(unit), *([] if args.no_rsync else [ctx.rsync_dest(img)]))
    res.extra["aging"] = {"rounds": len(rounds), "extents": extents,
                          "first_round": rounds[0] if rounds else None,
                          "last_round": rounds[-1] if rounds else None,
                          "capture_plus_plan_s": [round(r["capture_s"] + r["plan_s"], 4) for r in rounds]}
    if rounds:
        f, la = rounds[0], rounds[-1]
        print(f"aged: {len(rounds)} rounds, extents {extents['start']} -> {extents['aged']}; "
              f"round 1 capture {f['capture_s']:.4f} plan {f['plan_s']:.4f} freeze {f['freeze_s']:.4f} | "
              f"round {len(rounds)} capture {la['capture_s']:.4f} plan {la['plan_s']:.4f} "
              f"freeze {la['freeze_s']:.4f}", flush=True)
    return res
