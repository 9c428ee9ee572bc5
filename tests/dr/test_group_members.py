"""A member removed from a replicated group can be deleted at the peer.

The VolumeGroupReplication controller changes a group's members with
ModifyVolumeGroupMembership (kubernetes-csi-addons
internal/controller/replication.storage/volumegroupreplicationcontent_controller.go);
the volume that left is then deleted at each site by the external-provisioner's
DeleteVolume. The replica's record at the peer must follow the origin's member list.
"""
from __future__ import annotations

import grpc

from csi_plugin.gen import csi_pb2, volumegroup_pb2
from tests.dr.helpers import code_of, wait_synced_after, write_random

INTERVAL = {"schedulingInterval": "2s"}


def test_member_removed_at_origin_is_deletable_at_peer(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    gid = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="app")).volume_group.volume_group_id
    keep, leave = (A.create_volume(f"app-m{i}", 32 << 20, volumeGroup=gid).volume_id for i in range(2))
    for i, vid in enumerate((keep, leave)):
        write_random(sa, vid, seed=i)
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
    wait_synced_after(lab, gid, [keep, leave])

    def delete_at_b():
        return code_of(lambda: B.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=leave)))
    # while it is a member, the peer refuses to delete it (it belongs to the replica group)
    assert delete_at_b() == grpc.StatusCode.FAILED_PRECONDITION

    A.groups.ModifyVolumeGroupMembership(volumegroup_pb2.ModifyVolumeGroupMembershipRequest(
        volume_group_id=gid, volume_ids=[keep]))
    write_random(sa, keep, count=4, seed=9)
    wait_synced_after(lab, gid, [keep])

    grp = B.groups.ControllerGetVolumeGroup(volumegroup_pb2.ControllerGetVolumeGroupRequest(volume_group_id=gid))
    assert [v.volume_id for v in grp.volume_group.volumes] == [keep]
    assert delete_at_b() == grpc.StatusCode.OK
    assert delete_at_b() == grpc.StatusCode.OK          # repeat-safe
    assert not (sb.pool / "images" / f"{leave}.img").exists()
    assert code_of(lambda: B.controller.ControllerGetVolume(
        csi_pb2.ControllerGetVolumeRequest(volume_id=leave))) == grpc.StatusCode.NOT_FOUND
    # the member that stays keeps replicating
    write_random(sa, keep, count=4, seed=10)
    wait_synced_after(lab, gid, [keep])
