"""The range algebra of undo maps (drsvc.replication.points.undo_log): pure, no I/O."""
from __future__ import annotations

import numpy as np
import pytest

from drsvc.replication.common import ranges
from drsvc.replication.points import undo_log as pd

pytestmark = pytest.mark.fast


def m(*rows):
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def r(*pairs):
    return ranges.normalize([a for a, _ in pairs], [b for _, b in pairs])


def rows(x):
    return [tuple(t) for t in x.tolist()]


@pytest.mark.parametrize("mp,want,expect", [
    # a row cut at both ends: the position moves with the start
    (m((0, 8192, 4096)), r((4096, 6144)), [(4096, 2048, 8192)]),
    # zero rows stay zero
    (m((0, 4096, -1), (8192, 4096, 0)), r((0, 12288)), [(0, 4096, -1), (8192, 4096, 0)]),
    # a want range spanning two rows and a gap gives two pieces
    (m((0, 4096, 0), (4096, 4096, 8192)), r((2048, 6144)), [(2048, 2048, 2048), (4096, 2048, 8192)]),
    # several want ranges inside one row, and nothing outside the map
    (m((0, 16384, 0)), r((0, 4096), (8192, 12288), (20000, 30000)), [(0, 4096, 0), (8192, 4096, 8192)]),
    (m((0, 4096, 0)), r(), []),
])
def test_clip(mp, want, expect):
    assert rows(pd.clip(mp, want)) == expect


def test_maps_round_trip_and_their_cover():
    mp = m((8192, 4096, 0), (0, 4096, -1), (12288, 100, 4096))
    assert rows(pd.decode_map(pd.encode_map(mp))) == rows(mp)
    merged = pd.merge_maps(m((8192, 4096, 0)), m((0, 4096, -1), (12288, 100, 4096)))
    assert [t[0] for t in rows(merged)] == [0, 8192, 12288]
    s, e = pd.covered(merged)
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == [(0, 4096), (8192, 12388)]
    assert pd.map_bytes(merged) == 4096 + 100
    assert pd.log_end(merged) == 8192            # the 100-byte row takes a whole 4 KiB slot
    assert pd.log_end(m((0, 4096, -1))) == 0
