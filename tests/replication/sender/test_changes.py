"""The pure planner: extent diffs and block runs."""
import pytest

from drsvc.host.fiemap import FIEMAP_EXTENT_DELALLOC, FIEMAP_EXTENT_UNWRITTEN, Extent
from drsvc.replication.sender import changes
from drsvc.replication.common.blockmap import ZERO

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so

def E(lo, ph, ln, fl=0):
    return Extent(lo, ph, ln, fl)


def test_extent_diff_finds_exactly_the_remapped_blocks():
    bs = 4096
    base = [E(0, 1 << 20, 64 * bs)]
    new = [E(0, 1 << 20, 10 * bs), E(10 * bs, 9 << 20, bs), E(11 * bs, (1 << 20) + 11 * bs, 53 * bs)]
    ms = changes.plan_from_extents(new, base, 64 * bs, 64 * bs, bs)
    assert ms.scan == [(10 * bs, 11 * bs)] and ms.clear == []


def test_extent_diff_holes_and_growth():
    bs = 4096
    base = [E(0, 1 << 20, 16 * bs)]
    # blocks 4..8 punched, file grown from 16 to 32 blocks with data at block 20
    new = [E(0, 1 << 20, 4 * bs), E(8 * bs, (1 << 20) + 8 * bs, 8 * bs), E(20 * bs, 7 << 20, bs)]
    ms = changes.plan_from_extents(new, base, 32 * bs, 16 * bs, bs)
    assert ms.clear == [(4 * bs, 8 * bs)]
    assert ms.scan == [(20 * bs, 21 * bs)]


def test_untrusted_and_unwritten_extents():
    bs = 4096
    base = [E(0, 1 << 20, 8 * bs)]
    new = [E(0, 1 << 20, 4 * bs, FIEMAP_EXTENT_DELALLOC), E(4 * bs, 0, 4 * bs, FIEMAP_EXTENT_UNWRITTEN)]
    ms = changes.plan_from_extents(new, base, 8 * bs, 8 * bs, bs)
    assert ms.scan == [(0, 4 * bs)]          # delalloc: physical unknown, must hash
    assert ms.clear == [(4 * bs, 8 * bs)]    # unwritten reads zeros: base data there is cleared


def test_size_change_rescans_boundary_blocks():
    bs = 4096
    base = [E(0, 1 << 20, 3 * bs)]
    ms = changes.plan_from_extents(base, base, 5 * bs, 2 * bs + 100, bs)
    assert ms.scan == [(2 * bs, 3 * bs)]


def test_full_scan_clears_holes_over_the_base():
    ms = changes.plan_full_scan([(4096, 8192)], 16384, 12288, 4096)
    assert ms.scan == [(4096, 8192)] and ms.clear == [(0, 4096), (8192, 12288)]


def d(i):
    return bytes([i]) * 16


def test_changed_runs():
    base = d(1) + d(2) + d(3) + ZERO + d(5)
    new = d(1) + d(9) + ZERO + ZERO + d(6)
    assert changes.changed_runs(new, base, 100) == [(101, 1, False), (102, 1, True), (104, 1, False)]
    assert changes.changed_runs(base, base, 0) == []
    assert changes.changed_runs(d(7) * 3, ZERO * 3, 0) == [(0, 3, False)]
    assert changes.nonzero_runs(ZERO + d(1) + d(2) + ZERO, 10) == [(11, 2)]
