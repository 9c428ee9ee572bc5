"""The pure planner: interval algebra, extent diffs, block runs, reconciliation."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drsvc.errors import ReplicaIsPrimary, ReplicationConflict
from drsvc.host.fiemap import FIEMAP_EXTENT_DELALLOC, FIEMAP_EXTENT_UNWRITTEN, Extent
from drsvc.replication import plan
from drsvc.replication.blockmap import ZERO

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so

intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=8)


def as_set(iv):
    return {x for s, e in iv for x in range(s, e)}


@given(intervals, intervals)
@settings(max_examples=200)
def test_interval_algebra_matches_sets(a, b):
    assert as_set(plan.subtract(a, b)) == as_set(a) - as_set(b)
    assert as_set(plan.intersect(a, b)) == as_set(a) & as_set(b)
    assert as_set(plan.normalize(a + b)) == as_set(a) | as_set(b)
    n = plan.normalize(a)
    assert all(n[i][1] < n[i + 1][0] for i in range(len(n) - 1))


def test_round_out_and_in():
    assert plan.round_out([(100, 5000)], 4096, 10000) == [(0, 8192)]
    assert plan.round_out([(9000, 9500)], 4096, 9500) == [(8192, 9500)]
    assert plan.round_in([(100, 13000)], 4096) == [(4096, 12288)]
    assert plan.round_in([(100, 4000)], 4096) == []


def E(lo, ph, ln, fl=0):
    return Extent(lo, ph, ln, fl)


def test_extent_diff_finds_exactly_the_remapped_blocks():
    bs = 4096
    base = [E(0, 1 << 20, 64 * bs)]
    new = [E(0, 1 << 20, 10 * bs), E(10 * bs, 9 << 20, bs), E(11 * bs, (1 << 20) + 11 * bs, 53 * bs)]
    ms = plan.plan_from_extents(new, base, 64 * bs, 64 * bs, bs)
    assert ms.scan == [(10 * bs, 11 * bs)] and ms.clear == []


def test_extent_diff_holes_and_growth():
    bs = 4096
    base = [E(0, 1 << 20, 16 * bs)]
    # blocks 4..8 punched, file grown from 16 to 32 blocks with data at block 20
    new = [E(0, 1 << 20, 4 * bs), E(8 * bs, (1 << 20) + 8 * bs, 8 * bs), E(20 * bs, 7 << 20, bs)]
    ms = plan.plan_from_extents(new, base, 32 * bs, 16 * bs, bs)
    assert ms.clear == [(4 * bs, 8 * bs)]
    assert ms.scan == [(20 * bs, 21 * bs)]


def test_untrusted_and_unwritten_extents():
    bs = 4096
    base = [E(0, 1 << 20, 8 * bs)]
    new = [E(0, 1 << 20, 4 * bs, FIEMAP_EXTENT_DELALLOC), E(4 * bs, 0, 4 * bs, FIEMAP_EXTENT_UNWRITTEN)]
    ms = plan.plan_from_extents(new, base, 8 * bs, 8 * bs, bs)
    assert ms.scan == [(0, 4 * bs)]          # delalloc: physical unknown, must hash
    assert ms.clear == [(4 * bs, 8 * bs)]    # unwritten reads zeros: base data there is cleared


def test_size_change_rescans_boundary_blocks():
    bs = 4096
    base = [E(0, 1 << 20, 3 * bs)]
    ms = plan.plan_from_extents(base, base, 5 * bs, 2 * bs + 100, bs)
    assert ms.scan == [(2 * bs, 3 * bs)]


def test_full_scan_clears_holes_over_the_base():
    ms = plan.plan_full_scan([(4096, 8192)], 16384, 12288, 4096)
    assert ms.scan == [(4096, 8192)] and ms.clear == [(0, 4096), (8192, 12288)]


def d(i):
    return bytes([i]) * 16


def test_changed_runs():
    base = d(1) + d(2) + d(3) + ZERO + d(5)
    new = d(1) + d(9) + ZERO + ZERO + d(6)
    assert plan.changed_runs(new, base, 100) == [(101, 1, False), (102, 1, True), (104, 1, False)]
    assert plan.changed_runs(base, base, 0) == []
    assert plan.changed_runs(d(7) * 3, ZERO * 3, 0) == [(0, 3, False)]
    assert plan.nonzero_runs(ZERO + d(1) + d(2) + ZERO, 10) == [(11, 2)]


def test_reconcile():
    P = plan.Pending(5, "tx5", ("a",))
    peer = {"exists": True, "generation": 4, "role": "secondary", "txid": "tx4"}
    assert plan.reconcile("u", 4, None, peer, ["a"]) == ["sync"]
    assert plan.reconcile("u", 4, P, peer, ["a"]) == ["resume"]
    assert plan.reconcile("u", 4, P, peer, ["a", "b"]) == ["discard", "sync"]
    committed = dict(peer, generation=5, txid="tx5")
    assert plan.reconcile("u", 4, P, committed, ["a"]) == ["finalize", "sync"]
    assert plan.reconcile("u", 4, P, committed, ["a"], mode="compare") == ["finalize", "compare"]
    assert plan.reconcile("u", 0, None, {"exists": False}, ["a"]) == ["sync"]
    with pytest.raises(ReplicationConflict):
        plan.reconcile("u", 4, None, dict(peer, generation=7), ["a"])
    with pytest.raises(ReplicationConflict):
        plan.reconcile("u", 3, None, {"exists": False, "generation": 0}, ["a"])
    with pytest.raises(ReplicaIsPrimary):
        plan.reconcile("u", 4, None, dict(peer, role="primary"), ["a"])


def test_reconcile_settles_a_prepared_round_first():
    """A part of a group spanning nodes whose peer holds round R prepared (its decision was
    read while connecting): commit -> the peer applies it, we adopt it, then the next round;
    abort -> the peer drops it, so do we."""
    P = plan.Pending(5, "tx5", ("a",))
    journal = {"txid": "tx5", "base": 4, "target": 5, "committed": False, "prepared": True, "round": "r"}
    peer = {"exists": True, "generation": 4, "role": "secondary", "txid": "tx4"}
    commit = dict(peer, journal=dict(journal, decision=True))
    abort = dict(peer, journal=dict(journal, decision=False))
    assert plan.reconcile("u", 4, P, commit, ["a"]) == ["settle", "finalize", "sync"]
    assert plan.reconcile("u", 4, P, abort, ["a"]) == ["settle", "discard", "sync"]
    assert plan.reconcile("u", 4, None, abort, ["a"]) == ["settle", "sync"]
    with pytest.raises(ReplicationConflict):      # applied there, but we kept no copy of it
        plan.reconcile("u", 4, None, commit, ["a"])
