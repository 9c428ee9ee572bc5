"""Verify's read rate beside its floor: a plain cold sequential read of the same image.

An image of random data (no holes: every block is read and hashed) is read cold, page cache
dropped for the file (POSIX_FADV_DONTNEED) before each pass, twice per round: once plainly
(1 MiB preads, the floor) and once as a verify reads it (``scrub_plan.plan_windows`` windows,
``blockmap.hash_range``: read and hash each block), uncapped. Printed per round and as
medians: wall seconds, rate, CPU seconds and CPU per GiB (the verify's is the hash), and the
verify's rate as a fraction of the floor's. Run on the pool's filesystem (``--dir``) for a
figure that means something; the machine is shared, so say so beside any figure.

    python -m bench.verify --dir /srv/pool --size 1G --rounds 3

``--held`` measures instead the sync interval a unit holds while its replica is verified: a
two-site lab (drsvc_lab: loop XFS pools, redis, sshd, the real scheduler and workers), one
volume of random data replicating every ``--interval`` seconds while a writer changes a few
blocks, and site b's ``verify_read_rate`` set to ``--cap``. The same unit's syncs are timed
for ``--window`` seconds without a verify, then while capped verifies of it run back to back
for as long, and the medians of both are printed side by side: the interval between sync
starts, the schedule delay (how late each started after its slot) and the sync's duration.

    python -m bench.verify --held --interval 2 --mib 256 --cap 24MiB/s --window 40
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from drsvc.replication.common import hash_range
from drsvc.replication.control import VERIFY_WINDOW_BYTES as WINDOW_BYTES, plan_windows

BS = 4096
CHUNK = 1 << 20


def _cold(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def plain_read(fd: int, size: int) -> None:
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    pos = 0
    while pos < size:
        pos += os.preadv(fd, [mv], pos) or size


def verify_read(fd: int, size: int) -> None:
    buf = bytearray(CHUNK)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    for first, count in plan_windows(size, BS, WINDOW_BYTES):
        hash_range(fd, first, count, BS, size, buf)


def make_image(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 << 20)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.verify")
    ap.add_argument("--dir", default=None, help="where the image goes (the pool's filesystem)")
    ap.add_argument("--size", default="1G", help="image size: 512M, 1G, ...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--held", action="store_true", help="the sync interval held while verifying (a lab)")
    ap.add_argument("--interval", type=int, default=2, help="--held: the unit's sync interval, seconds")
    ap.add_argument("--mib", type=int, default=256, help="--held: the volume's size (all of it data), MiB")
    ap.add_argument("--cap", default="24MiB/s", help="--held: site b's verify_read_rate")
    ap.add_argument("--window", type=float, default=40, help="--held: seconds measured per phase")
    args = ap.parse_args(argv)
    if args.held:
        from bench.verify_held import held
        return held(args)
    size = int(args.size[:-1]) << {"M": 20, "G": 30}[args.size[-1]] if args.size[-1] in "MG" else int(args.size)
    gib = size / (1 << 30)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-verify-") as d:
        path = Path(d) / "image.img"
        t0 = time.perf_counter()
        make_image(path, size)
        print(f"image: {size >> 20} MiB of random data in {time.perf_counter() - t0:.1f}s ({path.parent})")
        fd = os.open(path, os.O_RDONLY)
        rows = []
        try:
            for r in range(args.rounds):
                _cold(fd)
                pw, pc = _timed(lambda: plain_read(fd, size))
                _cold(fd)
                vw, vc = _timed(lambda: verify_read(fd, size))
                rows.append((pw, pc, vw, vc))
                print(f"round {r + 1}: cold read {pw:.2f}s ({gib / pw:.2f} GiB/s, cpu {pc:.2f}s) | "
                      f"verify {vw:.2f}s ({gib / vw:.2f} GiB/s, cpu {vc:.2f}s) | verify/floor {pw / vw:.2f}x")
        finally:
            os.close(fd)
    med = [statistics.median(c) for c in zip(*rows, strict=True)]
    pw, pc, vw, vc = med
    print(f"median: cold sequential read {gib / pw:.2f} GiB/s (cpu {pc / gib:.2f} s/GiB); "
          f"verify {gib / vw:.2f} GiB/s (cpu {vc / gib:.2f} s/GiB); verify at {pw / vw:.2f}x the floor "
          "(goal >= 0.8x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
