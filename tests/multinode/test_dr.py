"""Two sites of two storage nodes each (drsvc_lab.NodesLab): every call goes to a site's
controller, which holds no pool; each node has its own pool (loop XFS), its own loopback
address with an sshd, its own worker, api worker and scheduler. A volume on node n1
replicates to n1 at the peer, one on n2 to n2 (node pairs), each node's sender talking to
its peer node's sshd. Planned failover and failback, and a forced failover with a resync,
with units on different nodes.

The callers' order is kubernetes-csi-addons' (internal/controller/replication.storage/
volumereplication_controller.go): Demote at the old primary, Promote at the new one; and
Ramen's forced failover: Promote with force at the survivor, then Demote and Resync (force)
at the old primary when it comes back."""
from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
import redis

from drsvc.replication.common.unit_state import find_state
from drsvc_lab import NodesLab
from tests.dr.helpers import code_of, wait_for, write_random
from tests.fixtures.sites import Client, image_sha

MiB = 1 << 20
NODE = "topology.drsvc.io/node"
INTERVAL = {"schedulingInterval": "2s"}


@contextmanager
def two_sites(root):
    """Sites a and b of nodes n1 and n2, up, with a client of each site's controller."""
    lab = NodesLab(root, sites=("a", "b"), nodes=("n1", "n2"), pool_size="1G", node_call_timeout=10)
    try:
        lab.build()
        lab.up()
        lab.clients = {s: Client(SimpleNamespace(endpoint=lab.endpoint_of(s))) for s in lab.sites}
        yield lab
        for c in lab.clients.values():
            c.close()
    finally:
        lab.teardown()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    with two_sites(tmp_path_factory.mktemp("mn-dr")) as lab:
        yield lab


def at(lab, site, node):
    """What tests.dr.helpers needs of a site: its pool (here, one node's)."""
    return SimpleNamespace(pool=lab.pool(node, site))


def _create_retrying(client, req, within: float = 60.0):
    """CreateVolume as external-provisioner calls it: UNAVAILABLE (a storage node that did
    not answer in time, as on a loaded CI machine while the lab's node agents start) is
    retried with backoff, on the same name (CreateVolume is idempotent by name); see
    kubernetes-csi/external-provisioner pkg/controller/controller.go, whose isFinalError
    counts UNAVAILABLE as transient (the claim is provisioned again). Any other code fails
    the test at once."""
    import time

    import grpc
    deadline, pause = time.monotonic() + within, 0.25
    while True:
        try:
            return client.controller.CreateVolume(req, timeout=60).volume
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 4.0)


def on(client, name, node, size=32 * MiB):
    from csi_plugin.gen import csi_pb2
    cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                                   access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
    req = csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                                      volume_capabilities=[cap])
    req.accessibility_requirements.preferred.add(segments={NODE: node})
    vol = _create_retrying(client, req)
    assert dict(vol.accessible_topology[0].segments)[NODE] == node
    return vol.volume_id


def gen(lab, site, node, unit) -> int:
    st = find_state(lab.pool(node, site), unit)
    return st.generation if st else 0


def synced(lab, vols: dict, src="a", dst="b", timeout=60):
    """Two more syncs of each volume from src have landed; its image matches at dst."""
    start = {v: gen(lab, src, n, v) for v, n in vols.items()}
    for v, n in vols.items():
        wait_for(lambda v=v, n=n: gen(lab, src, n, v) >= start[v] + 2, timeout, what=f"two syncs of {v} from {src}")
        assert image_sha(at(lab, src, n), v) == image_sha(at(lab, dst, n), v), v


def test_planned_failover_and_failback_across_nodes(two):
    A, B = two.clients["a"], two.clients["b"]
    vols = {on(A, "pf-1", "n1"): "n1", on(A, "pf-2", "n2"): "n2"}
    for v, n in vols.items():
        write_random(at(two, "a", n), v, seed=len(v))
        A.retry("EnableVolumeReplication", volume_id=v, parameters=INTERVAL, sidecar=True)
    synced(two, vols)
    for v, n in vols.items():
        # each replica is on the paired node at b, and nowhere else
        other = "n2" if n == "n1" else "n1"
        assert (two.pool(n, "b") / "images" / f"{v}.img").exists()
        assert not (two.pool(other, "b") / "images" / f"{v}.img").exists()
        info = A.call("GetVolumeReplicationInfo", volume_id=v)
        assert info.status == info.HEALTHY, info.status_message
        # the replica answers at b's controller under the same id, read-only
        assert code_of(lambda v=v: B.call("GetVolumeReplicationInfo", volume_id=v)) \
            == grpc.StatusCode.FAILED_PRECONDITION

    for v, n in vols.items():
        write_random(at(two, "a", n), v, count=4, seed=99)
        assert code_of(lambda v=v: B.call("PromoteVolume", volume_id=v)) == grpc.StatusCode.FAILED_PRECONDITION
        A.retry("DemoteVolume", volume_id=v)
        B.retry("PromoteVolume", volume_id=v)
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
        assert find_state(two.pool(n, "b"), v).epoch == find_state(two.pool(n, "a"), v).epoch + 1

    # failback: b now syncs back to a, node to node, only what changed
    for v, n in vols.items():
        write_random(at(two, "b", n), v, count=5, seed=5)
    synced(two, vols, src="b", dst="a")
    for v, n in vols.items():
        B.retry("DemoteVolume", volume_id=v)
        A.retry("PromoteVolume", volume_id=v)
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
    synced(two, vols)


def test_forced_failover_with_resync_on_a_node(two):
    """Node n2 of site a is lost (its sshd and workers stop); b promotes with force; n2
    comes back still primary and diverged; Demote, then Resync with force discards the
    divergent blocks. Site a's other node keeps syncing all along."""
    A, B = two.clients["a"], two.clients["b"]
    v1, v2 = on(A, "fo-1", "n1"), on(A, "fo-2", "n2")
    for v, n in ((v1, "n1"), (v2, "n2")):
        write_random(at(two, "a", n), v, seed=11)
        A.retry("EnableVolumeReplication", volume_id=v, parameters=INTERVAL, sidecar=True)
    synced(two, {v1: "n1", v2: "n2"})

    run = two.run_of("a")
    two.stop_sshd("a", "n2")
    for c in ("worker@n2", "scheduler@n2"):
        run.stop(c)
    try:
        B.retry("PromoteVolume", volume_id=v2, force=True, sidecar=True)
        write_random(at(two, "b", "n2"), v2, count=6, seed=12)
        # the other node of a is not held up
        synced(two, {v1: "n1"})
        write_random(at(two, "a", "n2"), v2, count=6, seed=13)     # split brain on n2
    finally:
        run.start("worker@n2")
        run.start("scheduler@n2")
        two.start_sshd("a", "n2")
    # the conflict shows at n2's first sync after its worker restarts. It once took over 60 s,
    # most likely as in the single-node split brain, where the logs showed it: both primaries'
    # syncs met and each receiver waited for the lock its own site's sync held. A primary's
    # receiver now refuses at once (tests/replication/test_sync.py).
    wait_for(lambda: A.call("GetVolumeReplicationInfo", volume_id=v2).status
             == A.call("GetVolumeReplicationInfo", volume_id=v2).ERROR, 60, what="a to report the conflict")
    A.retry("DemoteVolume", volume_id=v2)
    assert A.retry("ResyncVolume", volume_id=v2, force=True).ready is False
    wait_for(lambda: A.retry("ResyncVolume", volume_id=v2, force=True).ready, 60, what="resync to finish")
    assert image_sha(at(two, "a", "n2"), v2) == image_sha(at(two, "b", "n2"), v2)


def test_a_promote_its_controller_gave_up_on_is_not_run_late(two):
    """b's node n2 does not answer (its api worker is down) when b's controller asks it to
    promote, so the controller gives up (UNAVAILABLE, which Promote answers as UNKNOWN). The operator then keeps the volume at a
    (Promote with force there). When n2's api worker comes back, the call still queued for
    it must not promote b's copy too: two primaries. A node's Replication calls expire with
    their caller's wait (EXPIRING_NODE_OPS in workers/client.py); the CO's retry asks anew."""
    A, B = two.clients["a"], two.clients["b"]
    v = on(A, "late-1", "n2")
    write_random(at(two, "a", "n2"), v, seed=21)
    A.retry("EnableVolumeReplication", volume_id=v, parameters={"schedulingInterval": "1h"}, sidecar=True)
    wait_for(lambda: gen(two, "b", "n2", v) >= 1, 60, what="the initial sync")
    A.retry("DemoteVolume", volume_id=v)
    run = two.run_of("b")
    run.stop("api@n2")
    cfg = two.cfg_of("b")
    queued = redis.Redis.from_url(cfg.redis_url)
    try:
        # UNAVAILABLE inside, answered UNKNOWN: the replication seed's code for it on Promote
        assert code_of(lambda: B.call("PromoteVolume", volume_id=v)) == grpc.StatusCode.UNKNOWN
        # the Promote did reach n2's queue (the controller did not stop short of it)
        assert any(b"replication" in m and b"promote" in m for m in queued.lrange(cfg.api_queue("n2"), 0, -1))
        A.retry("PromoteVolume", volume_id=v, force=True)
    finally:
        run.start("api@n2")
    two.wait_nodes("b")             # n2 has read its queue: the stale call before this probe
    log = run.log_file("api@n2")
    wait_for(lambda: "Discarding revoked task" in log.read_text(), 30, what="n2's api worker to drop the call")
    time.sleep(2)                   # were it run, its promote task would have landed by now
    assert find_state(two.pool("n2", "b"), v).role == "secondary"
    assert find_state(two.pool("n2", "a"), v).role == "primary"
    A.retry("DisableVolumeReplication", volume_id=v)


def test_a_nodes_exporter_shows_its_units(two):
    """workers.metrics --node: the exporter of node n1 at site a reports n1's units (their
    ids name the node), none of n2's."""
    import subprocess
    import sys
    import urllib.request
    A = two.clients["a"]
    v1, v2 = on(A, "m-1", "n1"), on(A, "m-2", "n2")
    for v, n in ((v1, "n1"), (v2, "n2")):
        write_random(at(two, "a", n), v, seed=3)
        A.retry("EnableVolumeReplication", volume_id=v, parameters=INTERVAL, sidecar=True)
    synced(two, {v1: "n1", v2: "n2"})
    cfg = two.cfg_of("a")
    p = subprocess.Popen([sys.executable, "-m", "workers.metrics", "--config", str(cfg.path), "--node", "n1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def scrape():
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{cfg.metrics_port}/metrics", timeout=2).read().decode()
            except OSError:
                return ""
        page = wait_for(scrape, 30, what="node n1's exporter")
        assert f'unit="{v1}"' in page and f'unit="{v2}"' not in page
        assert "drsvc_replication_lag_seconds" in page
    finally:
        p.terminate()
        p.wait(timeout=20)


def test_group_on_a_node_replicates_and_fails_over(two):
    """A volume group on a multi-node site: the group sits on a node, its members are made
    there (CreateVolume with volumeGroup), and it replicates and fails over as one unit to
    the paired node."""
    from csi_plugin.gen import volumegroup_pb2
    A, B = two.clients["a"], two.clients["b"]
    g = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="app")).volume_group
    gid = g.volume_group_id
    node = gid.partition(".")[0]
    assert node in two.nodes
    members = [A.create_volume(f"app-m{i}", 32 * MiB, volumeGroup=gid).volume_id for i in range(2)]
    assert all(m.startswith(f"{node}.") for m in members)
    got = A.groups.ControllerGetVolumeGroup(volumegroup_pb2.ControllerGetVolumeGroupRequest(volume_group_id=gid))
    assert sorted(v.volume_id for v in got.volume_group.volumes) == sorted(members)
    for m in members:
        write_random(at(two, "a", node), m, seed=len(m))
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
    start = gen(two, "a", node, gid)
    wait_for(lambda: gen(two, "a", node, gid) >= start + 2, 60, what="two syncs of the group")
    for m in members:
        assert image_sha(at(two, "a", node), m) == image_sha(at(two, "b", node), m)
    write_random(at(two, "a", node), members[0], count=4, seed=7)
    A.retry("DemoteVolume", group_id=gid)
    B.retry("PromoteVolume", group_id=gid)
    for m in members:
        assert image_sha(at(two, "a", node), m) == image_sha(at(two, "b", node), m)
    # the replica group answers at b's controller, on the paired node
    got = B.groups.ControllerGetVolumeGroup(volumegroup_pb2.ControllerGetVolumeGroupRequest(volume_group_id=gid))
    assert sorted(v.volume_id for v in got.volume_group.volumes) == sorted(members)



def test_group_spanning_nodes_fails_over_and_back_consistently(two):
    """A volume group with a member on each node: one part per node, each replicating to its
    peer node, every round cut at one instant on both nodes and committed on both or neither.
    Planned failover and failback, then a forced failover with resync, all as one group.

    The order of calls is kubernetes-csi-addons' volumegroupreplication controller
    (internal/controller/replication.storage/volumegroupreplication_controller.go): it
    creates the VolumeGroup with the PVCs' volume ids, then enables, demotes and promotes
    the group by its id; Ramen's forced failover adds Promote(force), Demote, Resync(force)."""
    from csi_plugin.gen import volumegroup_pb2
    A, B = two.clients["a"], two.clients["b"]
    vols = {on(A, "span-1", "n1"): "n1", on(A, "span-2", "n2"): "n2"}
    g = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(
        name="span", volume_ids=list(vols))).volume_group
    gid = g.volume_group_id
    assert sorted(v.volume_id for v in g.volumes) == sorted(vols)
    # retried: the same group
    again = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="span", volume_ids=list(vols)))
    assert again.volume_group.volume_group_id == gid
    listed = [e.volume_group for e in A.groups.ListVolumeGroups(volumegroup_pb2.ListVolumeGroupsRequest()).entries]
    assert [sorted(v.volume_id for v in x.volumes) for x in listed if x.volume_group_id == gid] == [sorted(vols)]
    for v, n in vols.items():
        write_random(at(two, "a", n), v, seed=len(v) + 3)
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)

    def rounds(site, k, timeout=90):
        start = {n: gen(two, site, n, gid) for n in two.nodes}
        wait_for(lambda: all(gen(two, site, n, gid) >= start[n] + k for n in two.nodes), timeout,
                 what=f"{k} rounds of the group from {site}")

    rounds("a", 2)
    for v, n in vols.items():
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
        assert not (two.pool("n2" if n == "n1" else "n1", "b") / "images" / f"{v}.img").exists()
    # every round landed on both peer nodes, cut at one instant (the parts' capture times)
    recs = {n: {r["generation"]: r for r in find_state(two.pool(n, "b"), gid).received} for n in two.nodes}
    common = sorted(set(recs["n1"]) & set(recs["n2"]))
    assert len(common) >= 2
    for G in common:
        assert abs(recs["n1"][G]["captured_at"] - recs["n2"][G]["captured_at"]) < 5.0
    for n in two.nodes:            # each part's syncs met the other at the cut and voted
        phases = find_state(two.pool(n, "a"), gid).reports[-1]["phases"]
        assert "cut_wait_s" in phases and "vote_s" in phases, phases
    info = A.call("GetVolumeReplicationInfo", group_id=gid)
    assert info.status == info.HEALTHY, info.status_message

    # planned failover: Demote at a (both parts' final syncs meet), Promote at b
    for v, n in vols.items():
        write_random(at(two, "a", n), v, count=4, seed=21)
    A.retry("DemoteVolume", group_id=gid)
    # read before the promote: b's first round back to a (every 2 s) carries b's new epoch
    # to a's parts, so read after, a's epoch may already be b's (CI saw {1} == {2})
    demoted_at = {find_state(two.pool(n, "a"), gid).epoch for n in two.nodes}
    assert len(demoted_at) == 1, demoted_at
    B.retry("PromoteVolume", group_id=gid)
    for v, n in vols.items():
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
    assert {find_state(two.pool(n, "b"), gid).epoch for n in two.nodes} == {demoted_at.pop() + 1}
    got = B.groups.ControllerGetVolumeGroup(volumegroup_pb2.ControllerGetVolumeGroupRequest(volume_group_id=gid))
    assert sorted(v.volume_id for v in got.volume_group.volumes) == sorted(vols)

    # failback: b's parts sync back to a, then b demotes and a promotes
    for v, n in vols.items():
        write_random(at(two, "b", n), v, count=5, seed=22)
    rounds("b", 2)
    B.retry("DemoteVolume", group_id=gid)
    A.retry("PromoteVolume", group_id=gid)
    for v, n in vols.items():
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
    rounds("a", 1)

    # forced failover: b promotes with force while a keeps writing (split brain on both
    # nodes); a demotes and resyncs with force, and both parts converge to b's data
    B.retry("PromoteVolume", group_id=gid, force=True, sidecar=True)
    for v, n in vols.items():
        write_random(at(two, "b", n), v, count=3, seed=23)
        write_random(at(two, "a", n), v, count=3, seed=24)
    A.retry("DemoteVolume", group_id=gid)
    A.retry("ResyncVolume", group_id=gid, force=True)
    wait_for(lambda: A.retry("ResyncVolume", group_id=gid, force=True).ready, 90, what="the group's resync")
    rounds("b", 1)
    for v, n in vols.items():
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
    # one generation at both parts of the replica: a round's decision reaches each part's
    # receiver from its own node's sender, so while the schedule runs one part may have
    # committed a round the other is about to (CI saw 9 and 10 once); they meet at once
    wait_for(lambda: len({gen(two, "a", n, gid) for n in two.nodes}) == 1, 30,
             what="both parts of the replica at one generation")


def test_a_spanning_groups_demote_waits_out_a_part_held_by_its_own_sync(two):
    """A Demote of a group spanning nodes while one node's part is held by a sync of its own
    (its lock taken here for 7 s, longer than a cut's 5 s freeze wait): the other part's cut
    is not met, and it tries again within the final sync's deadline instead of demoting
    without a final sync. The parts meet once the held one is free, the final round carries
    the demotion to both peer nodes, and b promotes without force. (CI at load 13 saw a
    failback's Promote refused with "the peer has not demoted" after a Demote whose final
    round failed that way.)"""
    import threading
    import time

    from csi_plugin.gen import volumegroup_pb2
    from drsvc import store
    from drsvc.layout import PoolLayout
    A, B = two.clients["a"], two.clients["b"]
    vols = {on(A, "held-1", "n1"): "n1", on(A, "held-2", "n2"): "n2"}
    gid = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(
        name="held", volume_ids=list(vols))).volume_group.volume_group_id
    for v, n in vols.items():
        write_random(at(two, "a", n), v, seed=31)
    A.retry("EnableVolumeReplication", group_id=gid, parameters={"schedulingInterval": "1h"})
    wait_for(lambda: all(gen(two, "b", n, gid) >= 1 for n in two.nodes), 90, what="the group's first round")
    for v, n in vols.items():
        write_random(at(two, "a", n), v, count=4, seed=32)

    held, release = threading.Event(), threading.Event()

    def hold():
        with store.file_lock(PoolLayout(two.pool("n1", "a")).lock_path(gid), key=gid):
            held.set()
            release.wait(7.0)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(30)
        t0 = time.monotonic()
        A.retry("DemoteVolume", group_id=gid)
        took = time.monotonic() - t0
    finally:
        release.set()
        t.join()
    assert took >= 5.0, took         # it did wait for the held part
    for n in two.nodes:
        st = find_state(two.pool(n, "a"), gid)
        assert st.role == "secondary" and not st.diverged, (n, st)
    B.retry("PromoteVolume", group_id=gid)
    for v, n in vols.items():
        assert image_sha(at(two, "a", n), v) == image_sha(at(two, "b", n), v)
