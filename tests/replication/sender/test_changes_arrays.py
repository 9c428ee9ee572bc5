"""The extent diff on arrays (``changes.plan_from_extent_arrays``) against the reference
(``changes.plan_from_extents``), on random extent maps: same scan and clear ranges."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drsvc.host.fiemap import (EXTENT_DTYPE, FIEMAP_EXTENT_DELALLOC, FIEMAP_EXTENT_SHARED,
                               FIEMAP_EXTENT_UNWRITTEN, Extent)
from drsvc.replication.sender import changes

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so

BS = 4096
FLAGS = st.sampled_from([0, 0, 0, FIEMAP_EXTENT_SHARED, FIEMAP_EXTENT_UNWRITTEN, FIEMAP_EXTENT_DELALLOC])


@st.composite
def extent_map(draw):
    """A file's extents: sorted, disjoint, with gaps (holes); physical from a small pool
    so that new and base often share mappings."""
    out, pos = [], 0
    for _ in range(draw(st.integers(0, 12))):
        pos += draw(st.sampled_from([0, 0, BS, 3 * BS, 100]))
        ln = draw(st.sampled_from([BS, 2 * BS, 5 * BS, 700]))
        phys = draw(st.sampled_from([1 << 20, 2 << 20, 3 << 20])) + pos
        out.append(Extent(pos, phys, ln, draw(FLAGS)))
        pos += ln
    return out


def to_array(exts):
    a = np.zeros(len(exts), dtype=np.dtype(EXTENT_DTYPE))
    for i, e in enumerate(exts):
        a[i]["logical"], a[i]["physical"], a[i]["length"], a[i]["flags"] = e.logical, e.physical, e.length, e.flags
    return a


def derive(base, draw):
    """A new map from a base: some extents kept as they are, some remapped, some dropped."""
    out = []
    for e in base:
        r = draw(st.integers(0, 3))
        if r == 0:
            continue
        out.append(e if r < 3 else Extent(e.logical, e.physical + (64 << 20), e.length, e.flags))
    return out


@given(st.data())
@settings(max_examples=400, deadline=None)
def test_vectorized_plan_equals_reference(data):
    base = data.draw(extent_map())
    new = derive(base, data.draw) + [e for e in data.draw(extent_map())
                                     if e.logical >= (base[-1].end if base else 0)]
    new_size = data.draw(st.sampled_from([0, 10 * BS, 20 * BS + 100, 40 * BS]))
    base_size = data.draw(st.sampled_from([0, 10 * BS, 20 * BS + 100, 40 * BS]))
    want = changes.plan_from_extents(new, base, new_size, base_size, BS)
    got = changes.plan_from_extent_arrays(to_array(new), to_array(base), new_size, base_size, BS)
    assert got.scan == want.scan
    assert got.clear == want.clear


@given(st.lists(st.sampled_from(["same", "data", "zero"]), min_size=32, max_size=300))
@settings(max_examples=200, deadline=None)
def test_changed_runs_array_path_equals_block_by_block(kinds):
    """Long windows take the array path; it names the same runs as the per-block loop
    (which short windows keep), checked by running the loop on 31-block pieces."""
    from drsvc.replication.common.blockmap import DIGEST, ZERO
    base = b"".join(bytes([1 + i % 200]) * DIGEST for i in range(len(kinds)))
    new = b"".join(base[i * DIGEST:(i + 1) * DIGEST] if k == "same" else
                   ZERO if k == "zero" else bytes([250]) * DIGEST for i, k in enumerate(kinds))
    got = changes.changed_runs(new, base, 1000)
    blocks = {}
    for first in range(0, len(kinds), 31):        # the loop path, block by block
        for b, c, z in changes.changed_runs(new[first * DIGEST:(first + 31) * DIGEST],
                                         base[first * DIGEST:(first + 31) * DIGEST], 1000 + first):
            blocks.update({b + i: z for i in range(c)})
    assert {b + i: z for b, c, z in got for i in range(c)} == blocks
    for (b1, c1, z1), (b2, _, z2) in zip(got, got[1:], strict=False):   # maximal runs
        assert b1 + c1 < b2 or z1 != z2
