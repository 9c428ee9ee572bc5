"""drsvc block deltas vs rsync over OpenSSH, on the same data.

    python -m bench.delta_vs_rsync [--json] [--size-gib 1]

Builds a loop-mounted XFS with two pools, starts a loopback sshd (the
replication key bound to our receiver, plus an unrestricted key for rsync) and
runs four cases, each --repeat times (best and median reported), drsvc then rsync
in the same run: `full` (initial copy of a random image; rsync --whole-file),
`1pct` and `10pct` (random 4 KiB rewrites; rsync --inplace --no-whole-file),
and `thin` (initial copy of a 10 GiB image with 100 MiB written; rsync --sparse).

drsvc runs in a child process per sync (its peak RSS is the sender's); drsvc_s
is the wall time of sync_unit there, connection setup included (a worker process
is long-lived, so interpreter start and imports are not counted). The receiver's
peak RSS is sampled from /proc while it runs. rsync wire bytes come from --stats.
Fairness: by default both tools start cold: before each run the source image,
drsvc's replica image and rsync's destination are evicted from the page cache
(per file, POSIX_FADV_DONTNEED; --warm skips it). drsvc reads a fresh reflink
snapshot (its own inode), which is cold in any case. Repeated `full`/`thin`
runs use hard links to the same image under new unit names (a fresh replica each).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import sys
import threading
import time
from pathlib import Path

from drsvc import runner

MiB, GiB = 1 << 20, 1 << 30


# -- child: one drsvc sync ------------------------------------------------------------
def child_sync(args) -> None:
    from drsvc.replication import sync_unit
    from drsvc.transport.ssh import SshPeer
    t = time.monotonic()
    peer = SshPeer("127.0.0.1", port=args.port, key_file=args.key, known_hosts=args.known_hosts)
    try:
        rep = sync_unit(args.pool, args.unit, [args.unit], peer)
    finally:
        peer.close()
    wall = time.monotonic() - t
    print(json.dumps({"wall_s": wall, "report": rep.to_dict(),
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


class ReceiverRss:
    """Samples the peak RSS (VmHWM) of running receiver processes."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"drsvc.replication.receiver" not in f.read():
                            continue
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmHWM:"):
                                self.peak = max(self.peak, int(line.split()[1]) * 1024)
                except OSError:
                    pass
            self._stop.wait(0.005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def write_random(path: Path, size: int, rnd: random.Random) -> None:
    with open(path, "wb") as f:
        for _ in range(size // (4 * MiB)):
            f.write(rnd.randbytes(4 * MiB))
        f.flush()
        os.fsync(f.fileno())   # a volume's data is on disk, not dirty in the cache


def rewrite_blocks(path: Path, fraction: float, rnd: random.Random) -> int:
    size = path.stat().st_size
    blocks = rnd.sample(range(size // 4096), int(size // 4096 * fraction))
    fd = os.open(path, os.O_RDWR)
    try:
        for b in blocks:
            os.pwrite(fd, rnd.randbytes(4096), b * 4096)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(blocks) * 4096


def run_drsvc(site, pool: Path, unit: str, rss: dict) -> dict:
    with ReceiverRss() as rr:
        res = runner.run([sys.executable, "-m", "bench.delta_vs_rsync", "--child-sync",
                          "--pool", pool, "--unit", unit, "--port", site.port,
                          "--key", site.client_key, "--known-hosts", site.known_hosts],
                         timeout=600)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rss["sender"] = max(rss["sender"], out["rss"])
    rss["receiver"] = max(rss["receiver"], rr.peak)
    return out


def run_rsync(site, src: Path, dest: Path, flags) -> tuple[float, int]:
    ssh = (f"ssh -c aes128-gcm@openssh.com -p {site.port} -i {site.plain_key} "
           f"-o UserKnownHostsFile={site.known_hosts} -o StrictHostKeyChecking=yes "
           f"-o BatchMode=yes -o IdentitiesOnly=yes")
    t = time.monotonic()
    res = runner.run(["rsync", *flags, "--stats", "-e", ssh, src, f"root@127.0.0.1:{dest}"], timeout=1200)
    wall = time.monotonic() - t
    sent = int(re.search(r"Total bytes sent: ([\d,]+)", res.stdout).group(1).replace(",", ""))
    recv = int(re.search(r"Total bytes received: ([\d,]+)", res.stdout).group(1).replace(",", ""))
    return wall, sent + recv


def _stats(xs):
    xs = sorted(xs)
    return {"best": round(xs[0], 4), "median": round(xs[len(xs) // 2] if len(xs) % 2
                                                      else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2, 4),
            "runs": [round(x, 4) for x in xs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.delta_vs_rsync")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--thin-gib", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (best and median reported)")
    ap.add_argument("--warm", action="store_true",
                    help="leave page caches as they are (default: both tools start cold)")
    ap.add_argument("--cases", default="full,1pct,10pct,thin")
    ap.add_argument("--no-rsync", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-sync", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pool"), ap.add_argument("--unit"), ap.add_argument("--port", type=int)
    ap.add_argument("--key"), ap.add_argument("--known-hosts")
    args = ap.parse_args(argv)
    if args.child_sync:
        child_sync(args)
        return 0

    from .site import drop_file_cache, loop_mounted_xfs, sshd_site
    rnd = random.Random(42)
    size = int(args.size_gib * GiB)
    wanted = set(args.cases.split(","))
    cases, rss = [], {"sender": 0, "receiver": 0}
    with loop_mounted_xfs("40G") as mnt:
        a, b, r = mnt / "a", mnt / "b", mnt / "rsync"
        for d in (a / "images", b / "images", r):
            d.mkdir(parents=True)
        with sshd_site(b) as site:
            img = a / "images" / "bench.img"
            write_random(img, size, rnd)

            def cold(*paths):
                if not args.warm:
                    drop_file_cache(*paths)

            def case(name, changed_fn, units, src_fn, rsync_flags):
                ds, rs, dw, rw, phases, changed = [], [], [], [], [], 0
                for i in range(args.repeat):
                    unit = units[i] if isinstance(units, list) else units
                    changed = changed_fn(i)
                    src = src_fn(i)
                    cold(src, b / "images" / f"{unit}.img")
                    d = run_drsvc(site, a, unit, rss)
                    ds.append(d["wall_s"])
                    dw.append(d["report"]["bytes_on_wire"])
                    phases.append(d["report"]["phases"])
                    if not args.no_rsync:
                        cold(src, r / src.name)
                        t, w = run_rsync(site, src, r / src.name, rsync_flags)
                        rs.append(t)
                        rw.append(w)
                c = {"name": name, "changed_bytes": changed, "drsvc_s": _stats(ds),
                     "drsvc_wire_bytes": max(dw), "rsync_s": _stats(rs) if rs else None,
                     "rsync_wire_bytes": max(rw) if rw else None, "drsvc_phases": phases}
                cases.append(c)
                rsb = c["rsync_s"]["best"] if rs else float("nan")
                rsm = c["rsync_s"]["median"] if rs else float("nan")
                print(f"{name:6} changed {changed / MiB:7.1f} MiB | drsvc best {c['drsvc_s']['best']:7.3f} s "
                      f"median {c['drsvc_s']['median']:7.3f} s {c['drsvc_wire_bytes'] / MiB:9.2f} MiB wire "
                      f"| rsync best {rsb:7.3f} s median {rsm:7.3f} s "
                      f"{(c['rsync_wire_bytes'] or 0) / MiB:9.2f} MiB wire", flush=True)
                for i, ph in enumerate(phases):
                    print(f"         run {i}: {ds[i]:.3f} s  phases {ph}", flush=True)

            def linked(base: Path, stem: str):
                def fn(i):
                    if i == 0:
                        return base
                    p = base.with_name(f"{stem}{i}.img")
                    if not p.exists():
                        os.link(base, p)
                    return p
                return fn

            reps = range(args.repeat)
            if "full" in wanted or "1pct" in wanted or "10pct" in wanted:
                case("full", lambda i: size, ["bench"] + [f"full{i}" for i in reps][1:],
                     linked(img, "full"), ["--whole-file", "--inplace"])
            if "1pct" in wanted:
                case("1pct", lambda i: rewrite_blocks(img, 0.01, rnd), "bench", lambda i: img,
                     ["--inplace", "--no-whole-file", "--ignore-times"])
            if "10pct" in wanted:
                case("10pct", lambda i: rewrite_blocks(img, 0.10, rnd), "bench", lambda i: img,
                     ["--inplace", "--no-whole-file", "--ignore-times"])
            if "thin" in wanted:
                thin = a / "images" / "thin.img"
                with open(thin, "wb") as f:
                    f.truncate(int(args.thin_gib * GiB))
                fd = os.open(thin, os.O_RDWR)
                try:
                    slots = rnd.sample(range(int(args.thin_gib * GiB) // MiB), 100)
                    for s in slots:
                        os.pwrite(fd, rnd.randbytes(MiB), s * MiB)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                case("thin", lambda i: 100 * MiB, ["thin"] + [f"thin{i}" for i in reps][1:],
                     linked(thin, "thin"), ["--sparse", "--whole-file"])
    print(f"peak RSS: sender {rss['sender'] / MiB:.1f} MiB, receiver {rss['receiver'] / MiB:.1f} MiB")
    print("caches: " + ("warm (as left)" if args.warm else
                        "cold for both tools: source, drsvc replica and rsync destination evicted "
                        "(POSIX_FADV_DONTNEED) before each run"))
    if args.json:
        print(json.dumps({"cases": cases, "peak_rss_bytes": rss, "cold": not args.warm,
                          "repeat": args.repeat}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
