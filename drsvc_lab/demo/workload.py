"""A database-like write pattern for the demo, and rsync's cost for the same change.

A page file rewritten in place (8 KiB pages, scattered) plus an append-only log, each
fsync'd, like a small OLTP database's checkpoint and WAL. ``rsync_cost`` runs
``rsync --no-whole-file --inplace --ignore-times --stats`` between two reflink copies of the
volume image (before and after the change, ``RsyncMirror``), which is what rsync would send
for the same change: it reads both whole images to find it.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path

from drsvc import runner
from drsvc.host.reflink import clone_file

PAGE = 8192


class DbFiles:
    def __init__(self, root: Path, *, pages_bytes: int, seed: int = 7):
        self.root = Path(root)
        self.pages_bytes = pages_bytes
        self.rnd = random.Random(seed)

    @property
    def pages(self) -> Path:
        return self.root / "db" / "pages.dat"

    @property
    def log(self) -> Path:
        return self.root / "db" / "wal.log"

    def create(self) -> int:
        self.pages.parent.mkdir(parents=True, exist_ok=True)
        with open(self.pages, "wb") as f:
            left = self.pages_bytes
            while left:
                n = min(left, 8 << 20)
                f.write(os.urandom(n))
                left -= n
            os.fsync(f.fileno())
        with open(self.log, "wb") as f:
            os.fsync(f.fileno())
        return self.pages_bytes

    def round(self, *, log_bytes: int, pages: int) -> int:
        """Append *log_bytes* to the log and rewrite *pages* random pages; returns bytes written."""
        with open(self.log, "ab") as f:
            f.write(os.urandom(log_bytes))
            os.fsync(f.fileno())
        n_pages = self.pages_bytes // PAGE
        with open(self.pages, "r+b") as f:
            for _ in range(pages):
                f.seek(self.rnd.randrange(n_pages) * PAGE)
                f.write(os.urandom(PAGE))
            os.fsync(f.fileno())
        return log_bytes + pages * PAGE


class RsyncMirror:
    """rsync's cost for each change of a volume image, measured between two reflink copies.

    ``start()`` copies the image as rsync's destination (the state the peer holds);
    ``measure()`` copies it again and runs rsync's delta algorithm from the new copy onto
    the old one in place, so the destination then equals the new state for the next round."""

    def __init__(self, image: Path, work: Path):
        self.image = Path(image)
        self.work = Path(work)
        self.held = self.work / "held.img"
        self.now = self.work / "now.img"

    @staticmethod
    def available() -> bool:
        return shutil.which("rsync") is not None

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        clone_file(self.image, self.held, fsync=False)

    def measure(self) -> dict | None:
        if not self.available():
            return None
        self.now.unlink(missing_ok=True)
        clone_file(self.image, self.now, fsync=False)
        cost = rsync_cost(self.held, self.now)
        self.now.unlink(missing_ok=True)
        return cost


def rsync_cost(before: Path, after: Path) -> dict | None:
    """Bytes rsync's delta algorithm sends to turn *before* into *after* (in place), and its time."""
    if shutil.which("rsync") is None:
        return None
    t0 = time.monotonic()
    r = runner.run(["rsync", "--no-whole-file", "--inplace", "--ignore-times", "--stats", after, before], timeout=600)
    took = time.monotonic() - t0
    return {"bytes_sent": _stat(r.stdout, "Total bytes sent"), "literal_bytes": _stat(r.stdout, "Literal data"),
            "seconds": round(took, 3)}


def _stat(text: str, label: str) -> int:
    m = re.search(rf"{label}: ([\d,.]+)", text)
    return int(re.sub(r"[,.]", "", m.group(1))) if m else 0
