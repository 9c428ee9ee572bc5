"""The sync driver: steps as objects, and a new plan after a lost connection.

The shape follows zrepl's replication driver (internal/replication/driver/
replication_driver.go): each attempt plans afresh from the state at both ends,
and only connectivity errors lead to another attempt."""
import os

import pytest

from drsvc.errors import PeerUnreachable
from drsvc.replication import peer_status, sync_unit
from drsvc.replication import plan as planner
from drsvc.replication.layout import PoolLayout
from drsvc.replication.steps import STEPS, Ship, plan_steps
from drsvc.transport.local import LocalPeer

from .conftest import make_image, new_sites, same_images, write_at

MiB = 1 << 20


class FailingOnce(LocalPeer):
    """A real local receiver that SIGKILLs itself at *point* on its first connection."""

    def __init__(self, pool, point):
        super().__init__(pool)
        self.points = [point]

    def open(self, verb, *args):
        self.env = ({**os.environ, "DRSVC_FAILPOINTS": self.points.pop()} if self.points
                    else None)
        return super().open(verb, *args)


def test_every_planned_step_name_has_a_class():
    names = set()
    for acked, pending, peer in [(0, None, {}), (1, planner.Pending(2, "t", ("v",)),
                                                 {"generation": 2, "txid": "t", "exists": True}),
                                 (1, planner.Pending(2, "t", ("v",)), {"generation": 1, "exists": True})]:
        names.update(planner.reconcile("u", acked, pending, peer, ["v"]))
    names.update(planner.reconcile("u", 1, None, {"generation": 3}, ["v"], "compare"))
    assert names == {"sync", "finalize", "resume", "compare"}
    assert names <= set(STEPS) and "discard" in STEPS
    steps = plan_steps(["finalize", "sync"])
    assert [s.name for s in steps] == ["finalize", "sync", "ship"] and isinstance(steps[-1], Ship)
    assert [s.name for s in plan_steps(["discard"])] == ["discard"]


@pytest.mark.parametrize("point, second", [("receiver.before_commit", ["resume"]),
                                           ("receiver.after_commit_marker", ["finalize", "sync"])])
def test_driver_plans_again_after_a_lost_connection(xfs_mod, point, second):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 16 * MiB, [(0, os.urandom(4 * MiB))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    write_at(img, MiB, os.urandom(MiB))
    write_at(img, 9 * MiB, os.urandom(64 << 10))
    # one attempt: the receiver dies, the error is the caller's, the generation stays pending
    with pytest.raises(PeerUnreachable):
        sync_unit(a, "v", ["v"], FailingOnce(b, point))
    assert (PoolLayout(a).snap_dir("v", 2) / "meta.json").exists()
    write_at(img, 12 * MiB, os.urandom(4096))
    # two attempts: the second plans from what both ends hold and completes
    peer = FailingOnce(b, point)
    r = sync_unit(a, "v", ["v"], peer, attempts=2)
    assert [x["error"] is None for x in r.attempts] == [False, True]
    assert r.attempts[1]["steps"] == second and r.steps == second
    st = peer_status(LocalPeer(b), "v")
    assert st["generation"] == r.target_generation == (2 if second == ["resume"] else 4)
    snap = PoolLayout(a).snap_dir("v", r.target_generation)
    if second == ["resume"]:
        assert r.resumed   # the pending generation (without the last write) is what the peer holds
        assert (snap / "v.img").read_bytes() == (b / "images" / "v.img").read_bytes()
        r = sync_unit(a, "v", ["v"], LocalPeer(b))
        assert r.steps == ["sync"] and r.attempts == [{"steps": ["sync"], "error": None}]
    same_images(a, b, ["v"])


def test_other_errors_are_not_retried(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", MiB, [(0, os.urandom(4096))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    make_image(a / "images" / "w.img", MiB, [(0, os.urandom(4096))])
    sync_unit(a, "w", ["w"], LocalPeer(b))
    # w's peer state moves away from what w acked: a typed conflict, planned once
    from drsvc.errors import ReplicationConflict
    from drsvc.replication import release_peer
    release_peer(LocalPeer(b), "w")
    peer = FailingOnce(b, "receiver.before_commit")
    peer.points = []
    with pytest.raises(ReplicationConflict):
        sync_unit(a, "w", ["w"], peer, attempts=3)
