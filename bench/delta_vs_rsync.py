"""drsvc block deltas vs rsync over OpenSSH, on the same data.

    python -m bench.delta_vs_rsync [--json] [--size-gib 1]

Builds a loop-mounted XFS with two pools, starts a loopback sshd (the
replication key bound to our receiver, plus an unrestricted key for rsync) and
runs four cases: `full` (initial copy of a random image; rsync --whole-file),
`1pct` and `10pct` (random 4 KiB rewrites; rsync --inplace --no-whole-file),
and `thin` (initial copy of a 10 GiB image with 100 MiB written; rsync --sparse).

drsvc runs in a child process per sync (its peak RSS is the sender's); drsvc_s
is the wall time of sync_unit there, connection setup included (a worker process
is long-lived, so interpreter start and imports are not counted). The receiver's
peak RSS is sampled from /proc while it runs. rsync wire bytes come from --stats.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.delta_vs_rsync")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--thin-gib", type=float, default=10.0)
    ap.add_argument("--child-sync", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pool"), ap.add_argument("--unit"), ap.add_argument("--port", type=int)
    ap.add_argument("--key"), ap.add_argument("--known-hosts")
    args = ap.parse_args(argv)
    if args.child_sync:
        child_sync(args)
        return 0

    from tests.fixtures.sshd import sshd_site
    from tests.fixtures.xfs import loop_mounted_fs
    rnd = random.Random(42)
    size = int(args.size_gib * GiB)
    cases, rss = [], {"sender": 0, "receiver": 0}
    with loop_mounted_fs("40G") as mnt:
        a, b, r = mnt / "a", mnt / "b", mnt / "rsync"
        for d in (a / "images", b / "images", r):
            d.mkdir(parents=True)
        with sshd_site(b, plain_key=True) as site:
            img = a / "images" / "bench.img"
            write_random(img, size, rnd)

            def case(name, changed, unit, src, rsync_flags):
                d = run_drsvc(site, a, unit, rss)
                rs, rw = run_rsync(site, src, r / src.name, rsync_flags)
                rep = d["report"]
                cases.append({"name": name, "changed_bytes": changed, "drsvc_s": round(d["wall_s"], 4),
                              "drsvc_wire_bytes": rep["bytes_on_wire"], "rsync_s": round(rs, 4),
                              "rsync_wire_bytes": rw, "drsvc_phases": rep["phases"],
                              "drsvc_scanned_bytes": rep["bytes_scanned"]})
                c = cases[-1]
                print(f"{name:6} changed {changed / MiB:9.1f} MiB | drsvc {c['drsvc_s']:7.3f} s "
                      f"{c['drsvc_wire_bytes'] / MiB:9.2f} MiB wire | rsync {rs:7.3f} s {rw / MiB:9.2f} MiB wire"
                      f" | time x{rs / max(c['drsvc_s'], 1e-9):5.1f}  wire x{rw / max(c['drsvc_wire_bytes'], 1):6.2f}",
                      flush=True)

            case("full", size, "bench", img, ["--whole-file", "--inplace"])
            case("1pct", rewrite_blocks(img, 0.01, rnd), "bench", img, ["--inplace", "--no-whole-file", "--ignore-times"])
            case("10pct", rewrite_blocks(img, 0.10, rnd), "bench", img, ["--inplace", "--no-whole-file", "--ignore-times"])
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
            case("thin", 100 * MiB, "thin", thin, ["--sparse", "--whole-file"])
    print(f"peak RSS: sender {rss['sender'] / MiB:.1f} MiB, receiver {rss['receiver'] / MiB:.1f} MiB")
    if args.json:
        print(json.dumps({"cases": cases, "peak_rss_bytes": rss}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
