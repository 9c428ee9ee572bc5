"""A database-like write pattern for the demo, and rsync's cost for the same change.

A page file rewritten in place (8 KiB pages, scattered) plus an append-only log, each
fsync'd, like a small OLTP database's checkpoint and WAL. ``rsync_cost`` runs
``rsync --no-whole-file --inplace --ignore-times --stats`` between two reflink copies of the volume image
(before and after the change), which is what rsync would send for the same change: it
reads both whole images to find it.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path

from drsvc import runner

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


def rsync_cost(before: Path, after: Path) -> dict | None:
    """Bytes rsync's delta algorithm sends to turn *before* into *after*, and its time."""
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
