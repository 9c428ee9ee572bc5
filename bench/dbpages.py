"""Case `dbpages`: database-like pages that compress about 2:1 (zstd where it pays).

An image of --db-mib MiB of 8 KiB pages, each half random (row data that does not
compress) and half structure: a header, a slot array and row descriptors that carry
the page's version, then zero padding. zstd level 1 packs such a page to about half
(:func:`page` is checked for that in tests/bench). Each run rewrites --db-pct percent
of the pages at random places with a new version of each (both 4 KiB blocks of a page
change), then syncs; rsync runs beside with --compress. Over a link, the floor that
zstd must beat is the raw changed bytes / rate + RTT (add_floors' data floor).
"""
from __future__ import annotations

import os
import random
import struct
from pathlib import Path

from .floor import coalesce
from .harness import MiB, RSYNC_DELTA, CaseResult, Run, measure, run_rsync, same_content

PAGE = 8192
ROW = 4096 - 64          # the random half, after the page header


def page(rnd: random.Random, number: int, version: int) -> bytes:
    """One 8 KiB page: a 64-byte header, 4032 random bytes, then row descriptors that name
    the page and its version (compressible), zero-padded to 8 KiB."""
    header = struct.pack("<QQQ", 0xD85A6E, number, version).ljust(64, b"\0")
    slots = b"".join(struct.pack("<IIHHQ", number, i, 32 * i, 32, version) for i in range(64))
    return (header + rnd.randbytes(ROW) + slots).ljust(PAGE, b"\0")


def write_pages(path: Path, pages, rnd: random.Random, version: int) -> None:
    """Write the given page numbers with *version*, then fsync."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for n in pages:
            os.pwrite(fd, page(rnd, n, version), n * PAGE)
        os.fsync(fd)
    finally:
        os.close(fd)


def dbpages_case(ctx) -> CaseResult:
    from .worker import case_worker, seed
    args = ctx.args
    res = CaseResult("dbpages", ctx.is_cold)
    img = ctx.image("dbpages")
    count = args.db_mib * MiB // PAGE
    write_pages(img, range(count), ctx.rnd, 0)
    per_run = max(1, int(count * args.db_pct / 100))

    def change(i):
        pages = ctx.rnd.sample(range(count), per_run)
        write_pages(img, pages, ctx.rnd, i + 1)
        return Run(per_run * PAGE, [(img, coalesce([p * PAGE for p in pages], PAGE))])
    with case_worker(ctx, res) as w:
        seed(ctx, w, img)
        measure(res, args.repeat, make_cold=ctx.cold, change=change, drsvc=lambda i: w.sync(ctx.a, img.stem),
                rsync=None if args.no_rsync else
                lambda i: run_rsync(ctx.site, img, ctx.rsync_dest(img), [*RSYNC_DELTA, "--compress"]))
    res.verified = same_content(img, ctx.replica(img.stem), *([] if args.no_rsync else [ctx.rsync_dest(img)]))
    res.extra.update({"image_bytes": count * PAGE, "page_bytes": PAGE, "pages_per_run": per_run,
                      "rsync_flags": "--compress"})
    return res
