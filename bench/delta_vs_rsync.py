"""drsvc block deltas vs rsync over OpenSSH, on the same data.

    python -m bench.delta_vs_rsync [--json] [--repeat 3] [--warm] [--cases full,1pct,...]
                                   [--link rtt=100ms,rate=1gbit [--full-mib 1024]]

Builds a loop-mounted XFS with two pools, starts a loopback sshd (the
replication key bound to our receiver, plus an unrestricted key for rsync) and
runs the cases, each --repeat times (best and median reported), drsvc then rsync
in the same run:

  full    initial copy of a random image (rsync --whole-file)
  1pct    1% random 4 KiB rewrites (rsync --inplace --no-whole-file)
  10pct   10% random 4 KiB rewrites
  thin    initial copy of a 10 GiB image with 100 MiB written (rsync --sparse)
  aged    a second image after 30 rounds of 1% rewrites, each synced; then 1% (bench/aged.py)
  idle    a few KiB changed, in a warm worker, >= 10 syncs (bench/idle.py)
  many    50 volumes of 256 MiB, 1% each, synced by ONE Celery worker through the real
          Celery path (own lab: redis, sshd, worker; bench/many.py), beside 50 rsync runs
  dbpages 10% of the 8 KiB pages of a database-like image rewritten, pages that zstd
          compresses about 2:1 (bench/dbpages.py), beside rsync --compress
  failover a planned failover with 8 MiB unsynced: DemoteVolume at a (its final sync),
          PromoteVolume at b, over gRPC (own lab, every component up; bench/failover.py)

--link rtt=R,rate=X (bench/link.py, bench/wan.py): site a reaches b's sshd through
a link emulator in its own process (drsvc's SSH peer, rsync's ssh, the many and
failover labs' peers too), each case reports its floor over the link (wire bytes
/ rate + RTT), its data floor (changed / rate + RTT) and drsvc's and rsync's
ratios to the floor; beside `full`, the emulator's own ceiling (a raw TCP push)
and 1 and 8 paramiko channels through it. The images the delta cases start from
are copied to b over loopback (untimed): over the link only what is timed.
drsvc's peer gets the link's rate as its `link_rate`, as the README tells operators to set
it (it sizes the stripes, and a delta whose bytes take 0.25 s or more on the wire at that
rate is pipelined). Default cases: full,1pct,idle,many,failover,dbpages.

drsvc syncs run in a warm bench worker (bench/worker.py), one per case: a
long-lived process that keeps the engine imported and its SSH session and warm
receivers open, as a Celery worker does; each case first syncs a small warm-up
unit (untimed). drsvc_s is the wall time of sync_unit there. Cold (default):
before the floor, drsvc and rsync of each run, both filesystems are synced and
every file in them, then the loop devices' backing files, is evicted from the
page cache (POSIX_FADV_DONTNEED; --drop-caches global uses drop_caches instead);
--warm leaves the caches as they are (the changed blocks were just written).
floor_s (cold runs): the changed blocks read cold, in offset order, same run.
Peak RSS: the bench worker's VmHWM (sender) and the receivers' (sampled).
rsync wire bytes come from --stats.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import ceilings
from .harness import GiB, MiB, RSYNC_DELTA, CaseResult, Run, measure, rewrite_blocks, run_rsync, same_content
from .harness import write_random
from .link import LinkSpecError, parse_link
from .wan import add_floors, bench_link, wan_ceilings
from .worker import seed_copy

LAN_CASES = "full,1pct,10pct,thin,aged,idle,many"
WAN_CASES = "full,1pct,idle,many,failover,dbpages"
ALL_CASES = LAN_CASES + ",failover,dbpages"


@dataclass
class Context:
    """One bench run's lab: pools a (source) and b (replica), rsync's directory, the sshd."""
    args: argparse.Namespace
    rnd: random.Random
    a: Path
    b: Path
    r: Path
    site: object
    cold: object            # site.Cold: makes caches cold (does nothing with --warm)
    tmp: Path
    warmup_unit: str = "warmup"
    link: object = None     # link.LinkSpec with --link
    direct: object = None   # the site over loopback (seeding), when `site` is reached through the link
    emulator: object = None  # (wan.LinkProcess, wan.Sink) with --link

    @property
    def is_cold(self) -> bool:
        return not self.args.warm

    def image(self, unit: str) -> Path:
        return self.a / "images" / f"{unit}.img"

    def replica(self, unit: str) -> Path:
        return self.b / "images" / f"{unit}.img"

    def rsync_dest(self, src: Path) -> Path:
        return self.r / src.name


def linked(base: Path, stem: str):
    """Run i's source: the base image, or a hard link to it under a new unit name."""
    def fn(i):
        if i == 0:
            return base
        p = base.with_name(f"{stem}{i}.img")
        if not p.exists():
            os.link(base, p)
        return p
    return fn


def copy_case(ctx: Context, name: str, base: Path, size: int, floor_ranges, rsync_flags) -> CaseResult:
    """An initial copy (full, thin): every run syncs the same data under a new unit name."""
    from .worker import case_worker
    res = CaseResult(name, ctx.is_cold)
    src = linked(base, base.stem + "-r")
    with case_worker(ctx, res) as w:
        def drsvc(i):
            return w.sync(ctx.a, src(i).stem)
        measure(res, ctx.args.repeat, make_cold=ctx.cold,
                change=lambda i: Run(size, [(src(i), floor_ranges)]), drsvc=drsvc,
                rsync=None if ctx.args.no_rsync else
                lambda i: run_rsync(ctx.site, src(i), ctx.rsync_dest(src(i)), rsync_flags))
    last = src(ctx.args.repeat - 1)
    paths = [last, ctx.replica(last.stem)] + ([] if ctx.args.no_rsync else [ctx.rsync_dest(last)])
    res.verified = same_content(*paths)
    return res


def delta_case(ctx: Context, name: str, unit: str, fraction: float) -> CaseResult:
    """Random 4 KiB rewrites of *fraction* of an image synced before."""
    from .floor import coalesce
    from .worker import case_worker
    res = CaseResult(name, ctx.is_cold)
    img = ctx.image(unit)

    def change(i):
        offs = rewrite_blocks(img, fraction, ctx.rnd)
        return Run(len(offs) * 4096, [(img, coalesce(offs))])
    with case_worker(ctx, res) as w:
        measure(res, ctx.args.repeat, make_cold=ctx.cold, change=change,
                drsvc=lambda i: w.sync(ctx.a, unit),
                rsync=None if ctx.args.no_rsync else
                lambda i: run_rsync(ctx.site, img, ctx.rsync_dest(img), RSYNC_DELTA))
    res.verified = same_content(img, ctx.replica(unit), *([] if ctx.args.no_rsync else [ctx.rsync_dest(img)]))
    return res


def thin_image(ctx: Context) -> tuple[Path, list]:
    thin = ctx.image("thin")
    size = int(ctx.args.thin_gib * GiB)
    with open(thin, "wb") as f:
        f.truncate(size)
    fd = os.open(thin, os.O_RDWR)
    slots = sorted(ctx.rnd.sample(range(size // MiB), ctx.args.thin_mib))
    try:
        for s in slots:
            os.pwrite(fd, ctx.rnd.randbytes(MiB), s * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    return thin, [(s * MiB, MiB) for s in slots]


def full_case(ctx: Context, wanted: set) -> CaseResult:
    """The initial copy of --full-mib (default: the image of the delta cases, which it then
    seeds; a separate image when the sizes differ, the delta cases' then seeded by seed_copy)."""
    args, size = ctx.args, int(ctx.args.size_gib * GiB)
    img = ctx.image("bench")
    write_random(img, size, ctx.rnd)
    full_size = args.full_mib * MiB if args.full_mib else size
    src = img if full_size == size else ctx.image("full")
    if src != img:
        write_random(src, full_size, ctx.rnd)
    res = copy_case(ctx, "full", src, full_size, [(0, full_size)], ["--whole-file", "--inplace"])
    if "full" in wanted and args.channel_mib:
        res.extra["channel"] = ceilings.channel(ctx.site, runs=args.repeat, nbytes=args.channel_mib * MiB)
        if ctx.emulator:
            res.extra["wan_ceilings"] = wan_ceilings(ctx.site, *ctx.emulator, runs=args.repeat,
                                                     nbytes=args.channel_mib * MiB)
    if src != img and wanted & {"1pct", "10pct"}:
        seed_copy(ctx, img)
    return res


def run_cases(ctx: Context, wanted: set) -> list[dict]:
    args = ctx.args
    img = ctx.image("bench")
    out = []

    def done(res: CaseResult):
        if ctx.link is not None:
            add_floors(res, ctx.link)
        res.print()
        out.append(res.to_dict())

    if wanted & {"full", "1pct", "10pct"}:
        done(full_case(ctx, wanted))
    for name, fraction in (("1pct", 0.01), ("10pct", 0.10)):
        if name in wanted:
            res = delta_case(ctx, name, "bench", fraction)
            res.extra["extent_costs"] = ceilings.extent_costs(img, res.phases, res.ranges_cloned)
            done(res)
    if "thin" in wanted:
        thin, ranges = thin_image(ctx)
        done(copy_case(ctx, "thin", thin, args.thin_mib * MiB, ranges, ["--sparse", "--whole-file"]))
    if "aged" in wanted:
        from .aged import aged_case
        done(aged_case(ctx))
    if "idle" in wanted:
        from .idle import idle_case
        done(idle_case(ctx))
    if "dbpages" in wanted:
        from .dbpages import dbpages_case
        done(dbpages_case(ctx))
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.delta_vs_rsync")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--size-gib", type=float, default=1.0, help="image of full/1pct/10pct/aged")
    ap.add_argument("--full-mib", type=int, default=0,
                    help="size of the full case's copy (default: the --size-gib image)")
    ap.add_argument("--thin-gib", type=float, default=10.0)
    ap.add_argument("--thin-mib", type=int, default=100, help="MiB written in the thin image")
    ap.add_argument("--aged-rounds", type=int, default=30)
    ap.add_argument("--idle-mib", type=int, default=256, help="image size of the idle case")
    ap.add_argument("--idle-kib", type=int, default=8, help="KiB changed per idle sync")
    ap.add_argument("--idle-syncs", type=int, default=12)
    ap.add_argument("--many-count", type=int, default=50)
    ap.add_argument("--many-mib", type=int, default=256)
    ap.add_argument("--db-mib", type=int, default=256, help="image size of the dbpages case")
    ap.add_argument("--db-pct", type=float, default=10.0, help="percent of its pages rewritten per run")
    ap.add_argument("--failover-mib", type=int, default=8, help="MiB written after the last sync")
    ap.add_argument("--failover-volume-mib", type=int, default=64)
    ap.add_argument("--channel-mib", type=int, default=None,
                    help="MiB pushed per run through an SSH channel alone, and with --link through the "
                         "emulator (full case; 0: skip; default 512, with --link 64)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (best and median reported)")
    ap.add_argument("--peer-fs", choices=("shared", "own"), default="shared",
                    help="the peer's pool on the primary's XFS, or on one of its own (the disk stays shared)")
    ap.add_argument("--ack", choices=("applied", "durable"), default="durable",
                    help="the peer's ack ([peers.<name>] ack): durable answers before the apply")
    ap.add_argument("--roll", choices=("behind", "inline"), default="behind",
                    help="the sender's base rolls forward after the sync returns (as a worker's job "
                         "syncs), or before it returns")
    ap.add_argument("--warm", action="store_true",
                    help="leave page caches as they are (default: every run starts cold)")
    ap.add_argument("--drop-caches", choices=("files", "global"), default="files",
                    help="how to make caches cold: per file and loop backing file (default), "
                         "or sync; echo 3 > /proc/sys/vm/drop_caches")
    ap.add_argument("--link", default=None, metavar="rtt=100ms,rate=1gbit[,queue=16MiB]",
                    help="site a reaches b through a link emulator (bench/link.py)")
    ap.add_argument("--cases", default=None, help=f"default {LAN_CASES}; with --link {WAN_CASES}")
    ap.add_argument("--no-rsync", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.link = parse_link(args.link) if args.link is not None else None
    except LinkSpecError as e:
        ap.error(f"--link: {e}")
    if args.cases is None:
        args.cases = WAN_CASES if args.link else LAN_CASES
    if args.channel_mib is None:
        args.channel_mib = 64 if args.link else 512
    unknown = set(args.cases.split(",")) - set(ALL_CASES.split(","))
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {ALL_CASES}")
    return args


def pool_cases(args, rnd, wanted: set) -> list[dict]:
    """Every case but the labs' (many, failover): pools a and b on one XFS, or (--peer-fs own)
    b and rsync's copies on a second one, as at two sites; one sshd."""
    from .site import Cold, backing_file, loop_mounted_xfs, sshd_site
    with contextlib.ExitStack() as stack:
        mnt = stack.enter_context(loop_mounted_xfs("40G"))
        peer_mnt = stack.enter_context(loop_mounted_xfs("40G")) if args.peer_fs == "own" else mnt
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="drsvc-bench-"))
        a, b, r = mnt / "a", peer_mnt / "b", peer_mnt / "rsync"
        for d in (a / "images", b / "images", r):
            d.mkdir(parents=True)
        mounts = sorted({mnt, peer_mnt})
        cold = Cold(mounts, [backing_file(m) for m in mounts], "off" if args.warm else args.drop_caches)
        with sshd_site(b) as site, bench_link(args.link, site) as (reached, link, sink):
            ctx = Context(args, rnd, a, b, r, reached, cold, Path(tmp), link=args.link, direct=site,
                          emulator=(link, sink) if link else None)
            write_random(ctx.image(ctx.warmup_unit), MiB, rnd)
            return run_cases(ctx, wanted)


def lab_cases(args, rnd, wanted: set) -> list[dict]:
    """many and idle_celery (bench/many.py), failover (bench/failover.py): labs of their own."""
    out = []
    runs = []
    if "many" in wanted:
        from .many import many_case
        runs += many_case(args, rnd)
    if "failover" in wanted:
        from .failover import failover_case
        runs.append(failover_case(args, rnd))
    for res in runs:
        if args.link is not None:
            add_floors(res, args.link)
        res.print()
        out.append(res.to_dict())
    return out


def main(argv=None) -> int:
    args = parse(argv)
    rnd = random.Random(42)
    wanted = set(args.cases.split(","))
    load0 = list(os.getloadavg())
    cases: list[dict] = []
    if wanted - {"many", "failover"}:
        cases += pool_cases(args, rnd, wanted)
    cases += lab_cases(args, rnd, wanted)
    print("caches: " + ("warm (as left: changed blocks just written)" if args.warm else
                        f"cold ({args.drop_caches}): before the floor, drsvc and rsync of every run"))
    rss = {"sender": max((c["peak_rss_bytes"]["sender"] for c in cases), default=0),
           "receiver": max((c["peak_rss_bytes"]["receiver"] for c in cases), default=0)}
    print(f"peak RSS over all cases: sender {rss['sender'] / MiB:.1f} MiB, receiver {rss['receiver'] / MiB:.1f} MiB")
    lk = args.link
    link = {"spec": lk.text(), "rtt_s": lk.rtt, "rate_bytes_s": lk.rate, "queue_bytes": lk.queue_bytes} if lk else None
    print(f"load average at start {load0}, at end {list(os.getloadavg())}" + (f"; link {lk.text()}" if lk else ""))
    if args.json:
        print(json.dumps({"cases": cases, "peak_rss_bytes": rss, "cold": not args.warm,
                          "drop_caches": None if args.warm else args.drop_caches, "repeat": args.repeat,
                          "link": link, "loadavg_start": load0, "loadavg": list(os.getloadavg())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
