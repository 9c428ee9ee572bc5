"""Reconciliation with the peer: the steps a sync takes, or a typed conflict."""
import pytest

from drsvc.errors import ReplicaIsPrimary, ReplicationConflict
from drsvc.replication.sender import reconcile as planner

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def test_reconcile():
    P = planner.Pending(5, "tx5", ("a",))
    peer = {"exists": True, "generation": 4, "role": "secondary", "txid": "tx4"}
    assert planner.reconcile("u", 4, None, peer, ["a"]) == ["sync"]
    assert planner.reconcile("u", 4, P, peer, ["a"]) == ["resume"]
    assert planner.reconcile("u", 4, P, peer, ["a", "b"]) == ["discard", "sync"]
    committed = dict(peer, generation=5, txid="tx5")
    assert planner.reconcile("u", 4, P, committed, ["a"]) == ["finalize", "sync"]
    assert planner.reconcile("u", 4, P, committed, ["a"], mode="compare") == ["finalize", "compare"]
    assert planner.reconcile("u", 0, None, {"exists": False}, ["a"]) == ["sync"]
    with pytest.raises(ReplicationConflict):
        planner.reconcile("u", 4, None, dict(peer, generation=7), ["a"])
    with pytest.raises(ReplicationConflict):
        planner.reconcile("u", 3, None, {"exists": False, "generation": 0}, ["a"])
    with pytest.raises(ReplicaIsPrimary):
        planner.reconcile("u", 4, None, dict(peer, role="primary"), ["a"])


def test_reconcile_settles_a_prepared_round_first():
    """A part of a group spanning nodes whose peer holds round R prepared (its decision was
    read while connecting): commit -> the peer applies it, we adopt it, then the next round;
    abort -> the peer drops it, so do we."""
    P = planner.Pending(5, "tx5", ("a",))
    journal = {"txid": "tx5", "base": 4, "target": 5, "committed": False, "prepared": True, "round": "r"}
    peer = {"exists": True, "generation": 4, "role": "secondary", "txid": "tx4"}
    commit = dict(peer, journal=dict(journal, decision=True))
    abort = dict(peer, journal=dict(journal, decision=False))
    assert planner.reconcile("u", 4, P, commit, ["a"]) == ["settle", "finalize", "sync"]
    assert planner.reconcile("u", 4, P, abort, ["a"]) == ["settle", "discard", "sync"]
    assert planner.reconcile("u", 4, None, abort, ["a"]) == ["settle", "sync"]
    with pytest.raises(ReplicationConflict):      # applied there, but we kept no copy of it
        planner.reconcile("u", 4, None, commit, ["a"])
