"""The floor of a cold sync: the time to read exactly the changed blocks, cold, in offset order.

Adjacent changed blocks are read as one range (a good reader coalesces them);
readahead is switched off (POSIX_FADV_RANDOM), so no block outside the change is read.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

CHUNK = 8 << 20


def coalesce(offsets: Iterable[int], length: int = 4096) -> list[tuple[int, int]]:
    """Sorted, merged (offset, length) ranges of blocks of *length* bytes at *offsets*."""
    out: list[list[int]] = []
    for off in sorted(offsets):
        if out and out[-1][0] + out[-1][1] >= off:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return [(o, n) for o, n in out]


def read_ranges(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Read *ranges* of *path* in order; returns the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    got = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off, n in ranges:
            end = off + n
            while off < end:
                b = os.pread(fd, min(CHUNK, end - off), off)
                if not b:
                    break
                got += len(b)
                off += len(b)
    finally:
        os.close(fd)
    return got


def floor_s(files: list[tuple[Path, list[tuple[int, int]]]], make_cold: Callable[[], None]) -> float:
    """Evict the caches, then time reading every file's ranges (files in the order given)."""
    make_cold()
    t = time.monotonic()
    for path, ranges in files:
        read_ranges(path, ranges)
    return time.monotonic() - t
