"""Case `idle`: a sync with a few KiB changed, in a warm worker (session already open).

The fixed cost of one sync caps how many volumes a node can protect. Each run
rewrites --idle-kib KiB (4 KiB blocks at random places) of an image synced
before, then syncs it; caches stay warm (the blocks were just written), as on
a live volume. rsync runs beside on the same data (its cost grows with the image,
not the change: the image size is in the JSON).
"""
from __future__ import annotations

from .harness import MiB, RSYNC_DELTA, CaseResult, Run, measure, rewrite_blocks, run_rsync, same_content
from .harness import write_random


def idle_case(ctx) -> CaseResult:
    from .worker import case_worker, seed
    args = ctx.args
    res = CaseResult("idle", False)          # warm by definition: no floor
    unit = "idle"
    img = ctx.image(unit)
    write_random(img, args.idle_mib * MiB, ctx.rnd)
    blocks = max(1, args.idle_kib // 4)
    with case_worker(ctx, res) as w:
        seed(ctx, w, img)                                     # the initial copies (untimed)
        w.sync(ctx.a, unit)                                   # and one with nothing changed

        def change(i):
            offs = rewrite_blocks(img, 0, ctx.rnd, count=blocks)
            return Run(len(offs) * 4096)
        measure(res, max(args.idle_syncs, 1), make_cold=lambda: None, change=change,
                drsvc=lambda i: w.sync(ctx.a, unit),
                rsync=None if args.no_rsync else
                lambda i: run_rsync(ctx.site, img, ctx.rsync_dest(img), RSYNC_DELTA))
    res.verified = same_content(img, ctx.replica(unit), *([] if args.no_rsync else [ctx.rsync_dest(img)]))
    res.extra["image_bytes"] = args.idle_mib * MiB
    res.extra["goal_s"] = 0.030
    return res
