"""An early capture maps the live image in windows (``capture._map_windows``), so the first
records wait for one FIEMAP batch, not the whole map. Planned window by window and clipped,
the ranges must be exactly those of one plan of the whole map: checked here on extent maps
made up to cover what a real one holds (shared and moved extents, holes on either side,
unwritten extents, a base of another size, batches that end mid-block and mid-extent)."""
import random

import numpy as np
import pytest

from drsvc.host.fiemap import EXTENT_DTYPE, FIEMAP_EXTENT_LAST, FIEMAP_EXTENT_UNWRITTEN
from drsvc.replication.sender import capture
from drsvc.replication.sender import changes as planner
from drsvc.replication.common import ranges


def normalize(intervals):
    return ranges.pairs(ranges.from_pairs(intervals))

pytestmark = pytest.mark.fast
K = 4096


def _extents(rows):
    a = np.zeros(len(rows), dtype=np.dtype(EXTENT_DTYPE))
    for i, (logical, physical, length, flags) in enumerate(rows):
        a[i]["logical"], a[i]["physical"], a[i]["length"], a[i]["flags"] = logical, physical, length, flags
    if len(rows):
        a[-1]["flags"] |= FIEMAP_EXTENT_LAST
    return a


# (cumulative odds, in the base, in the live image, the live extent's physical shift, its flags)
KINDS = [(0.15, False, False, 0, 0),                        # a hole in both
         (0.60, True, True, 0, 0),                          # shared
         (0.75, True, True, 1 << 30, 0),                    # written since: moved
         (0.85, True, False, 0, 0),                         # punched since
         (0.95, False, True, 0, 0),                         # new data where the base had a hole
         (1.00, False, True, 0, FIEMAP_EXTENT_UNWRITTEN)]   # preallocated, unwritten


def _maps(rnd, size, base_size):
    """A base and a live image: the live one shares most extents, moved some, lost some to
    holes and gained new ones where the base had holes."""
    base, new, pos, phys = [], [], 0, 1 << 40
    while pos < max(size, base_size):
        length = rnd.choice([1, 1, 2, 3, 8, 40]) * K
        r = rnd.random()
        _odds, in_base, in_new, shift, flags = next(k for k in KINDS if r < k[0])
        if in_base and pos < base_size:
            base.append((pos, phys, min(length, base_size - pos), 0))
        if in_new and pos < size:
            new.append((pos, phys + shift, min(length, size - pos), flags))
        pos += length
        phys += length + K * rnd.randrange(0, 3)
    return _extents(base), _extents(new)


def _batches(arr, rnd, first):
    i, n = 0, first
    while i < len(arr):
        yield arr[i:i + n]
        i += n
        n = rnd.choice([1, 2, 5, 17, 64])


@pytest.mark.parametrize("seed", range(12))
def test_windows_plan_what_one_plan_of_the_whole_map_does(seed):
    rnd = random.Random(seed)
    size = rnd.randrange(64, 4096) * K + rnd.choice([0, 0, 512, 1000])
    base_size = rnd.choice([size, size - 7 * K, size + 9 * K, size // 2])
    base_size -= base_size % 512
    bs, fs_block = rnd.choice([(4096, 4096), (8192, 4096), (65536, 4096), (4096, 65536)])
    base, new = _maps(rnd, size, base_size)
    whole = planner.plan_from_extent_arrays(new, base, size, base_size, bs)
    parts: list = []
    wins = list(capture._map_windows(_batches(new, rnd, rnd.choice([1, 3, 10])), size, (base, base_size), bs,
                                     fs_block, parts))
    assert wins[0].start == 0 and wins[-1].end == size
    assert all(a.end == b.start for a, b in zip(wins, wins[1:], strict=False))
    assert normalize([r for w in wins for r in w.ms.scan]) == normalize(whole.scan)
    assert normalize([r for w in wins for r in w.ms.clear]) == normalize(whole.clear)
    assert normalize([r for w in wins for r in w.clone]) == normalize(capture._round_out(whole.scan, fs_block, size))
    assert np.array_equal(np.concatenate(parts) if parts else new[:0], new)


def test_an_image_without_extents_is_one_window():
    base = _extents([(0, 1 << 40, 8 * K, 0)])
    wins = list(capture._map_windows(iter(()), 16 * K, (base, 16 * K), K, K, []))
    assert [(w.start, w.end) for w in wins] == [(0, 16 * K)]
    assert wins[0].ms.clear == [(0, 8 * K)] and wins[0].ms.scan == []
