"""Range sets (``common.ranges``), the engine's one interval algebra: pure, no I/O."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drsvc.replication.common import ranges

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so
BS = 4096
R, P = ranges.from_pairs, ranges.pairs


intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=8)


def as_set(iv):
    return {x for s, e in iv for x in range(s, e)}


@given(intervals, intervals)
@settings(max_examples=200, deadline=None)
def test_interval_algebra_matches_sets(a, b):
    assert as_set(P(ranges.subtract(R(a), R(b)))) == as_set(a) - as_set(b)
    assert as_set(P(ranges.intersect(R(a), R(b)))) == as_set(a) & as_set(b)
    assert as_set(P(ranges.from_pairs(a + b))) == as_set(a) | as_set(b)
    n = P(ranges.from_pairs(a))
    assert all(n[i][1] < n[i + 1][0] for i in range(len(n) - 1))


def test_round_out_and_in():
    assert P(ranges.round_out(R([(100, 5000)]), 4096, 10000)) == [(0, 8192)]
    assert P(ranges.round_out(R([(9000, 9500)]), 4096, 9500)) == [(8192, 9500)]
    assert P(ranges.round_in(R([(100, 13000)]), 4096)) == [(4096, 12288)]
    assert P(ranges.round_in(R([(100, 4000)]), 4096)) == []


def test_vectorized_interval_algebra():
    iv = ranges.normalize([5, 0, 3, 20], [8, 4, 6, 20])
    assert list(zip(iv[0].tolist(), iv[1].tolist(), strict=True)) == [(0, 8)]
    a = ranges.normalize([0, 100], [50, 200])
    b = ranges.normalize([10, 150], [20, 300])
    s, e = ranges.subtract(a, b)
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == [(0, 10), (20, 50), (100, 150)]


@given(st.lists(st.lists(st.integers(-5, 40).map(lambda x: x * BS), max_size=30), max_size=4))
@settings(max_examples=200, deadline=None)
def test_boundaries_are_the_sorted_distinct_values(arrays):
    """ranges.boundaries (a sort and a mask) gives what np.unique gives, for any
    number of arrays, empty ones and repeats included."""
    arrs = [np.asarray(a, dtype=np.int64) for a in arrays]
    want = np.unique(np.concatenate(arrs)) if arrs else np.zeros(0, dtype=np.int64)
    got = ranges.boundaries(*arrs)
    assert got.dtype == np.int64
    assert got.tolist() == want.tolist()


@given(intervals, st.integers(0, 260), st.integers(0, 60))
@settings(max_examples=200, deadline=None)
def test_clip_and_total_match_sets(a, lo, n):
    assert as_set(P(ranges.clip(R(a), lo, lo + n))) == as_set(a) & set(range(lo, lo + n))
    assert ranges.total(R(a)) == len(as_set(a))
    assert ranges.total(ranges.union(R(a), ranges.empty())) == len(as_set(a))


def test_pairs_are_python_ints():
    [(s, e)] = P(ranges.round_out(R([(1, 2)]), BS, 10 * BS))
    assert (s, e) == (0, BS) and type(s) is int and type(e) is int
