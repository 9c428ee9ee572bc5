"""The CSI-Addons controllers' call sequences, replayed on a two-site lab through the
plugin sockets in the sidecar's request form (replication_source).

Upstream: csi-addons/kubernetes-csi-addons, internal/controller/replication.storage/.
Every loop is bounded (tests.consumers.flows.requeue), as no call may be retried forever.
"""
from __future__ import annotations

import time

from csi_plugin.gen import csi_pb2, volumegroup_pb2
from drsvc.replication.common.unit_state import find_state
from tests.consumers.flows import Code, requeue, status_of
from tests.dr.helpers import wait_for, wait_synced_after, write_random
from tests.fixtures.sites import image_sha

CLASS = {"schedulingInterval": "2s",
         "replication.storage.openshift.io/replication-secret-name": "s",
         "replication.storage.openshift.io/replication-secret-namespace": "ns"}
GROUP_CLASS = {"schedulingInterval": "2s", "peer": "b"}      # the VolumeGroupReplicationClass, prefix stripped


def mark_primary(client, **src):
    """volumereplication_controller.go Reconcile, case Primary: enableReplication, then
    markVolumeAsPrimary: Promote(force=false), and Promote(force=true) when that answers
    FAILED_PRECONDITION (volumePromotionKnownErrors). Returns the promote codes seen."""
    requeue(lambda: client.call("EnableVolumeReplication", sidecar=True, parameters=CLASS, **src),
            lambda c, r: c == Code.OK, what="enable")
    code, _ = status_of(lambda: client.call("PromoteVolume", sidecar=True, force=False, **src))
    codes = [code]
    if code == Code.FAILED_PRECONDITION:
        code, _ = status_of(lambda: client.call("PromoteVolume", sidecar=True, force=True, **src))
        codes.append(code)
    return codes


def mark_secondary(client, *, auto_resync, attempts=80, **src):
    """volumereplication_controller.go Reconcile, case Secondary: markVolumeAsSecondary
    (Demote) on the first pass; on later passes Demote again, then resyncVolume with
    force = spec.autoResync, requeued while ready is false. Returns (ready, codes)."""
    # an error requeues the request (with backoff): ABORTED while a sync holds the unit
    seen, _ = requeue(lambda: client.call("DemoteVolume", sidecar=True, **src),
                      lambda c, r: c != Code.ABORTED, what="first demote")
    if seen[-1] != Code.OK:
        return False, seen
    for _ in range(attempts):
        code, _ = status_of(lambda: client.call("DemoteVolume", sidecar=True, **src))
        seen.append(code)
        if code == Code.OK:
            code, resp = status_of(lambda: client.call("ResyncVolume", sidecar=True, force=auto_resync, **src))
            seen.append(code)
            if code == Code.OK and resp.ready:
                return True, seen
        time.sleep(0.5)
    return False, seen


def test_vr_primary_enable_then_promote(lab):
    """volumereplication_controller.go: Reconcile (Primary) -> enableReplication ->
    markVolumeAsPrimary; getVolumeReplicationInfo for the status (NOT_FOUND is a known error
    until the first sync)."""
    A, B = lab.clients["a"], lab.clients["b"]
    vol = A.create_volume("vrp", 64 << 20).volume_id
    # unknown peer: INVALID_ARGUMENT (not NOT_FOUND); this site's own name is accepted
    code, _ = status_of(lambda: A.call("EnableVolumeReplication", volume_id=vol, sidecar=True,
                                       parameters={**CLASS, "peer": "nowhere"}))
    assert code == Code.INVALID_ARGUMENT
    lab.stop_sshd("b")                                          # the first sync cannot land yet
    A.retry("EnableVolumeReplication", volume_id=vol, sidecar=True, parameters={**CLASS, "peer": "a"})
    code, _ = status_of(lambda: A.call("GetVolumeReplicationInfo", volume_id=vol, sidecar=True))
    assert code == Code.NOT_FOUND
    lab.start_sshd("b")
    requeue(lambda: A.call("GetVolumeReplicationInfo", volume_id=vol, sidecar=True),
            lambda c, r: c == Code.OK and r.last_sync_time.seconds > 0, what="first sync")
    # at the primary itself the controller's sequence ends with OK at once
    assert mark_primary(A, volume_id=vol) == [Code.OK]
    # the same class at site b, where the volume is a secondary: Enable is OK (the
    # controller calls it before Promote), and Promote without a demoted peer is
    # FAILED_PRECONDITION, which the controller answers with a forced promote
    wait_for(lambda: find_state(lab.sites["b"].pool, vol), 30, what="replica at b")
    lab.stop_sshd("a")
    lab.sites["a"].run.stop("worker")
    assert mark_primary(B, volume_id=vol) == [Code.FAILED_PRECONDITION, Code.OK]
    assert find_state(lab.sites["b"].pool, vol).role == "primary"
    lab.sites["a"].run.start("worker")
    lab.start_sshd("a")


def _vgr_group(client, name, vols):
    """volumegroupreplicationcontent_controller.go Reconcile: CreateVolumeGroup(name,
    spec.source.volumeHandles, class parameters with the prefixed keys filtered)."""
    req = volumegroup_pb2.CreateVolumeGroupRequest(name=name, volume_ids=vols, parameters=GROUP_CLASS)
    return client.groups.CreateVolumeGroup(req, timeout=60).volume_group.volume_group_id


def test_vgr_create_enable_modify(lab):
    """volumegroupreplicationcontent_controller.go Reconcile (CreateVolumeGroup with the class
    parameters, later ModifyVolumeGroupMembership with them) and volumereplication_controller.go
    for the group's VolumeReplication (Enable, Promote). Items 2, 6 and 11."""
    A, B = lab.clients["a"], lab.clients["b"]
    sa = lab.sites["a"]
    vols = [A.create_volume(f"vgr{i}", 32 << 20).volume_id for i in range(3)]
    # Enable answers only its seed codes: an empty group is INVALID_ARGUMENT, not FAILED_PRECONDITION
    empty = _vgr_group(A, "vgrcontent-empty", [])
    code, _ = status_of(lambda: A.call("EnableVolumeReplication", group_id=empty, parameters=GROUP_CLASS))
    assert code == Code.INVALID_ARGUMENT
    gid = _vgr_group(A, "vgrcontent-1", vols[:2])
    for v in vols:
        write_random(sa, v, count=4, seed=len(v))
    assert mark_primary(A, group_id=gid) == [Code.OK]
    wait_synced_after(lab, gid, vols[:2])
    # the reconcile sends the full member list again, now with a third volume
    m = A.groups.ModifyVolumeGroupMembership(volumegroup_pb2.ModifyVolumeGroupMembershipRequest(
        volume_group_id=gid, volume_ids=vols, parameters=GROUP_CLASS), timeout=60).volume_group
    assert sorted(v.volume_id for v in m.volumes) == sorted(vols)
    wait_synced_after(lab, gid, vols)
    # at the secondary the VolumeGroupReplicationContent controller resends the unchanged member
    # list on every reconcile (kubernetes-csi-addons
    # internal/controller/replication.storage/volumegroupreplicationcontent_controller.go): OK,
    # in any order, and nothing changes
    for order in (vols, vols[::-1]):
        same = B.groups.ModifyVolumeGroupMembership(volumegroup_pb2.ModifyVolumeGroupMembershipRequest(
            volume_group_id=gid, volume_ids=order, parameters=GROUP_CLASS), timeout=60).volume_group
        assert sorted(v.volume_id for v in same.volumes) == sorted(vols)
    # a change there is the primary's to make: refused
    code, _ = status_of(lambda: B.groups.ModifyVolumeGroupMembership(
        volumegroup_pb2.ModifyVolumeGroupMembershipRequest(volume_group_id=gid, volume_ids=vols[:1],
                                                           parameters=GROUP_CLASS), timeout=60))
    assert code == Code.FAILED_PRECONDITION
    # the VolumeGroupReplicationContent made at b (Ramen, at failover) names the replica's volumes:
    # CreateVolumeGroup answers the replica group
    assert _vgr_group(B, "vgrcontent-at-b", vols) == gid


def _ramen_group(lab, name):
    A = lab.clients["a"]
    vols = [A.create_volume(f"{name}{i}", 32 << 20).volume_id for i in range(3)]
    gid = _vgr_group(A, f"vgrcontent-{name}", vols)
    for v in vols:
        write_random(lab.sites["a"], v, count=6, seed=hash(v) & 0xFFFF)
    assert mark_primary(A, group_id=gid) == [Code.OK]
    wait_synced_after(lab, gid, vols)
    return gid, vols


def _same_everywhere(lab, vols):
    for v in vols:
        assert image_sha(lab.sites["a"], v) == image_sha(lab.sites["b"], v), v


def test_ramen_planned_relocate_of_a_group(lab):
    """RamenDR/ramen internal/controller/vrg_volrep.go (processVRAsSecondary, then
    processVRAsPrimary at the peer, with autoResync false for a relocate) over the
    VolumeGroupReplication of 3 volumes; kubernetes-csi-addons volumereplication_controller.go
    Reconcile for the calls. Ends with checksums equal at both sites."""
    A, B = lab.clients["a"], lab.clients["b"]
    gid, vols = _ramen_group(lab, "rel")
    # A: the application is gone; the group's VR goes secondary (final sync), resync without force
    ready, codes = mark_secondary(A, group_id=gid, auto_resync=False)
    assert ready, codes
    # B: Ramen restores the PVs, the VGRContent adopts the replica group, the VR goes primary
    assert _vgr_group(B, "vgrcontent-rel-at-b", vols) == gid
    assert mark_primary(B, group_id=gid) == [Code.OK]              # planned: no force needed
    for v in vols:
        write_random(lab.sites["b"], v, count=3, seed=len(v) + 7)
    wait_synced_after(lab, gid, vols, src="b", dst="a")
    ready, codes = mark_secondary(A, group_id=gid, auto_resync=False)
    assert ready, codes
    _same_everywhere(lab, vols)
    # the restored PVs' topology is the one b's node advertises
    got = B.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vols[0])).volume
    node_b = B.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).accessible_topology.segments
    node_a = A.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).accessible_topology.segments
    assert dict(got.accessible_topology[0].segments) == dict(node_b) == dict(node_a)


def test_ramen_failover_of_a_group_then_resync(lab):
    """RamenDR/ramen internal/controller/vrg_volrep.go: failover promotes at the peer while the
    old primary is unreachable (Promote force=false, FAILED_PRECONDITION, force=true), then the
    old primary's VR goes secondary with autoResync true (processVRAsSecondary). Checksums at
    the end; with autoResync false the divergent data is kept and ready stays false."""
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    gid, vols = _ramen_group(lab, "fo")
    lab.stop_sshd("a")
    sa.run.stop("worker")
    assert _vgr_group(B, "vgrcontent-fo-at-b", vols) == gid
    assert mark_primary(B, group_id=gid) == [Code.FAILED_PRECONDITION, Code.OK]
    for v in vols:
        write_random(sb, v, count=3, seed=len(v) + 9)
        write_random(sa, v, count=2, seed=len(v) + 11)              # A kept writing: split brain
    sa.run.start("worker")
    lab.start_sshd("a")
    before = {v: image_sha(sa, v) for v in vols}
    # autoResync false: Demote, Resync(force=false) keeps answering ready=false; data untouched
    ready, codes = mark_secondary(A, group_id=gid, auto_resync=False, attempts=8)
    assert not ready and Code.OK in codes
    assert {v: image_sha(sa, v) for v in vols} == before
    # autoResync true (Ramen sets it for failover): ready once A holds exactly B's content
    ready, codes = mark_secondary(A, group_id=gid, auto_resync=True)
    assert ready, codes
    for v in vols:
        write_random(sb, v, count=2, seed=len(v) + 13)
    wait_synced_after(lab, gid, vols, src="b", dst="a")
    _same_everywhere(lab, vols)


def test_vr_deletion_with_peer_up_and_down(lab):
    """volumereplication_controller.go Reconcile on deletion -> disableVolumeReplication
    (NOT_FOUND is a known error there). With the peer up the peer's copy is released; with
    it down Disable still ends, and the peer's own VR deletion releases its side."""
    A, B = lab.clients["a"], lab.clients["b"]
    sb = lab.sites["b"]
    up = A.create_volume("del-up", 32 << 20).volume_id
    down = A.create_volume("del-down", 32 << 20).volume_id
    for v in (up, down):
        assert mark_primary(A, volume_id=v) == [Code.OK]
        wait_synced_after(lab, v, [v])
    requeue(lambda: A.call("DisableVolumeReplication", volume_id=up, sidecar=True),
            lambda c, r: c == Code.OK, what="disable, peer up")
    assert find_state(sb.pool, up) is None                         # released at b
    lab.stop_sshd("b")
    requeue(lambda: A.call("DisableVolumeReplication", volume_id=down, sidecar=True),
            lambda c, r: c == Code.OK, what="disable, peer down")
    code, _ = status_of(lambda: A.call("GetVolumeReplicationInfo", volume_id=down, sidecar=True))
    assert code == Code.FAILED_PRECONDITION
    lab.start_sshd("b")
    assert find_state(sb.pool, down).role == "secondary"          # b's copy waits for b's own VR
    requeue(lambda: B.call("DisableVolumeReplication", volume_id=down, sidecar=True),
            lambda c, r: c == Code.OK, what="disable at b")
    assert find_state(sb.pool, down) is None
    # a Disable repeated after the fact is OK, as the controller may repeat it
    assert status_of(lambda: A.call("DisableVolumeReplication", volume_id=down, sidecar=True))[0] == Code.OK
