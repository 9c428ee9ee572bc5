"""The floor of a cold sync: the time to read the changed blocks, cold, in offset order.

Adjacent changed blocks are read as one range (a good reader coalesces them).
Read twice, each time from cold caches: with readahead off (POSIX_FADV_RANDOM:
exactly the changed blocks, one request per range) and with the kernel's
readahead (dense changes then stream like a sequential read, as the issue's
10% figure of 0.7 s did). The floor is the faster of the two: the least time a
reader of those blocks needs.
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


def read_ranges(path: Path, ranges: list[tuple[int, int]], *, readahead: bool = False) -> int:
    """Read *ranges* of *path* in order; returns the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    got = 0
    try:
        if not readahead:
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


def timed_read(files: list[tuple[Path, list[tuple[int, int]]]], make_cold: Callable[[], None], *,
               readahead: bool) -> float:
    """Evict the caches, then time reading every file's ranges (files in the order given)."""
    make_cold()
    t = time.monotonic()
    for path, ranges in files:
        read_ranges(path, ranges, readahead=readahead)
    return time.monotonic() - t


def floor_s(files, make_cold: Callable[[], None]) -> dict:
    """{"floor_s": the faster, "exact_s": readahead off, "readahead_s": readahead on}."""
    exact = timed_read(files, make_cold, readahead=False)
    ra = timed_read(files, make_cold, readahead=True)
    return {"floor_s": min(exact, ra), "exact_s": exact, "readahead_s": ra}
