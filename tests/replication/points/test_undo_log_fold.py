"""undo_log.append_rows (a fold's append, runs found with array operations) writes the same
log and returns the same map rows as the general ``append`` over ``log_pieces``, on a
reflink filesystem (runs shared) and on one without reflink (every range copied)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from drsvc.replication.common import ranges
from drsvc.replication.points import undo_log
from drsvc.replication.points.index import unshared_bytes

KiB = 1024


def _source_log(d: Path, rnd: random.Random):
    """An undo log as the receiver packs one: an image's ranges (scattered 4 KiB blocks, some
    64-256 KiB runs, a few unaligned small ranges, zeroed ones) appended in two turns."""
    img = d / "img"
    size = 64 << 20
    with open(img, "wb") as f:
        f.truncate(size)
        for _ in range(300):
            f.seek(rnd.randrange(0, size - 256 * KiB, 4096))
            f.write(rnd.randbytes(rnd.choice([4 * KiB, 4 * KiB, 8 * KiB, 64 * KiB, 256 * KiB])))
    starts = sorted(rnd.sample(range(0, size // (4 * KiB) - 64), 900))
    want = ([], [])
    last = -1
    for b in starts:
        s = b * 4 * KiB
        if s <= last:
            continue
        n = rnd.choice([4 * KiB, 4 * KiB, 4 * KiB, 12 * KiB, 64 * KiB, 128 * KiB, 1000, 5000])
        want[0].append(s)
        want[1].append(s + n)
        last = s + n
    ws, we = np.asarray(want[0], dtype=np.int64), np.asarray(want[1], dtype=np.int64)
    log = d / "src.undo"
    fd = os.open(img, os.O_RDONLY)
    try:
        half = len(ws) // 2
        m1, _ = undo_log.append(log, undo_log.image_pieces(fd, (ws[:half], we[:half]), size))
        m2, _ = undo_log.append(log, undo_log.image_pieces(fd, (ws[half:], we[half:]), size), after=m1)
    finally:
        os.close(fd)
    return undo_log.merge_maps(m1, m2)


def _moved(m, rnd: random.Random):
    """What a fold moves: the source's rows less what the older point covers already."""
    have_s = np.asarray(sorted(rnd.sample(range(0, 64 << 20, 64 * KiB), 200)), dtype=np.int64)
    have = (have_s, have_s + rnd.choice([4 * KiB, 16 * KiB, 64 * KiB]))
    return undo_log.clip(m, ranges.subtract(undo_log.covered(m), have))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fs", ["xfs", "plain"])
def test_append_rows_equals_append(xfs_mod, tmp_path, fs, seed):
    rnd = random.Random(seed)
    d = Path(xfs_mod if fs == "xfs" else tmp_path) / f"fold-{fs}-{seed}"
    d.mkdir()
    src_map = _source_log(d, rnd)
    moved = undo_log.in_log_order(_moved(src_map, rnd))
    assert len(moved) > 100 and (moved[:, 2] < 0).any() and (moved[:, 2] >= 0).any()
    # both destinations start as the same log with a map, and bytes past what the map names
    # (an unfinished copy's), which the append cuts off
    base = d / "base.undo"
    with open(base, "wb") as f:
        f.write(rnd.randbytes(96 * KiB))
    have = np.asarray([[0, 64 * KiB, 0], [1 << 20, 8 * KiB, 64 * KiB]], dtype=np.int64)
    logs = {k: d / f"{k}.undo" for k in ("general", "arrays")}
    for log in logs.values():
        log.write_bytes(base.read_bytes())
    fd = os.open(d / "src.undo", os.O_RDONLY)
    try:
        rows_g, n_g = undo_log.append(logs["general"], undo_log.log_pieces(fd, moved), after=have)
        rows_a, n_a = undo_log.append_rows(logs["arrays"], fd, moved, after=have)
    finally:
        os.close(fd)
    assert n_a == n_g
    assert rows_a.dtype == np.int64 and rows_a.tolist() == rows_g.tolist()
    assert logs["arrays"].read_bytes() == logs["general"].read_bytes()
    if fs == "xfs":          # runs were shared with the source: fewer bytes of its own than it moved
        assert unshared_bytes(logs["arrays"]) < n_a // 2


def test_append_rows_of_nothing(tmp_path):
    log = tmp_path / "empty.undo"
    rows, n = undo_log.append_rows(log, -1, undo_log.no_map())
    assert n == 0 and len(rows) == 0 and log.exists() and log.stat().st_size == 0
