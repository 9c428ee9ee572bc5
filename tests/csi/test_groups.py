"""CSI-Addons VolumeGroup through real gRPC: every RPC and error code of the seed."""
from __future__ import annotations

import grpc
import pytest

from csi_plugin.gen import (csi_pb2, identity_pb2, identity_pb2_grpc, volumegroup_pb2,
                            volumegroup_pb2_grpc)
from tests.fixtures.csi import capability

VG = volumegroup_pb2


def _code(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.details()
    return e.value.code()


@pytest.fixture
def groups(plugin):
    return volumegroup_pb2_grpc.ControllerStub(plugin.channel)


def test_group_lifecycle_and_errors(plugin, groups, paths):
    g = groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(name="g1", parameters={"maxVolumes": "2"})).volume_group
    again = groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(name="g1", parameters={"maxVolumes": "2"}))
    assert again.volume_group.volume_group_id == g.volume_group_id                     # idempotent by name
    assert _code(lambda: groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(
        name="g1", parameters={"maxVolumes": "3"}))) == grpc.StatusCode.ALREADY_EXISTS
    # keys of other classes are accepted and ignored (a class is shared by drivers); ours are validated
    g2 = groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(name="g2", parameters={"colour": "red"}))
    groups.DeleteVolumeGroup(VG.DeleteVolumeGroupRequest(volume_group_id=g2.volume_group.volume_group_id))
    assert _code(lambda: groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(
        name="g3", parameters={"maxVolumes": "many"}))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(name=""))) \
        == grpc.StatusCode.INVALID_ARGUMENT

    # CreateVolume with the group parameter joins it
    v1 = plugin.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="m1", capacity_range=csi_pb2.CapacityRange(required_bytes=64 << 20),
        volume_capabilities=[capability("ext4")], parameters={"volumeGroup": g.volume_group_id})).volume
    v2 = plugin.create("m2")
    v3 = plugin.create("m3")
    got = groups.ControllerGetVolumeGroup(VG.ControllerGetVolumeGroupRequest(volume_group_id=g.volume_group_id))
    assert [v.volume_id for v in got.volume_group.volumes] == [v1.volume_id]
    assert _code(lambda: plugin.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="m4", volume_capabilities=[capability("ext4")], parameters={"volumeGroup": "grp-missing"}))) \
        == grpc.StatusCode.NOT_FOUND

    # Modify: the diff, NOT_FOUND, RESOURCE_EXHAUSTED at the maximum, INVALID_ARGUMENT for another group's volume
    mod = groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=g.volume_group_id, volume_ids=[v2.volume_id, v1.volume_id]))
    assert sorted(v.volume_id for v in mod.volume_group.volumes) == sorted([v1.volume_id, v2.volume_id])
    assert _code(lambda: groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=g.volume_group_id, volume_ids=[v1.volume_id, v2.volume_id, v3.volume_id]))) \
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _code(lambda: groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=g.volume_group_id, volume_ids=["vol-nope"]))) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id="grp-nope", volume_ids=[]))) == grpc.StatusCode.NOT_FOUND
    other = groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(name="other")).volume_group
    assert _code(lambda: groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=other.volume_group_id, volume_ids=[v1.volume_id]))) == grpc.StatusCode.INVALID_ARGUMENT

    # a member cannot be deleted on its own
    assert _code(lambda: plugin.delete(v1.volume_id)) == grpc.StatusCode.FAILED_PRECONDITION
    # removing it from the group (the diff) frees it
    groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=g.volume_group_id, volume_ids=[v2.volume_id]))
    plugin.delete(v1.volume_id)

    # List pages; a bad token is ABORTED
    page = groups.ListVolumeGroups(VG.ListVolumeGroupsRequest(max_entries=1))
    assert len(page.entries) == 1 and page.next_token
    rest = groups.ListVolumeGroups(VG.ListVolumeGroupsRequest(starting_token=page.next_token))
    assert {e.volume_group.volume_group_id for e in list(page.entries) + list(rest.entries)} == \
        {g.volume_group_id, other.volume_group_id}
    assert _code(lambda: groups.ListVolumeGroups(VG.ListVolumeGroupsRequest(starting_token="zz"))) \
        == grpc.StatusCode.ABORTED
    assert _code(lambda: groups.ControllerGetVolumeGroup(VG.ControllerGetVolumeGroupRequest(
        volume_group_id="grp-nope"))) == grpc.StatusCode.NOT_FOUND

    # Delete: FAILED_PRECONDITION while a member is staged; then it deletes the members
    staging, _ = paths("vg")
    plugin.stage(v2.volume_id, staging)
    assert _code(lambda: groups.DeleteVolumeGroup(VG.DeleteVolumeGroupRequest(
        volume_group_id=g.volume_group_id))) == grpc.StatusCode.FAILED_PRECONDITION
    plugin.unstage(v2.volume_id, staging)
    groups.DeleteVolumeGroup(VG.DeleteVolumeGroupRequest(volume_group_id=g.volume_group_id))
    groups.DeleteVolumeGroup(VG.DeleteVolumeGroupRequest(volume_group_id=g.volume_group_id))   # idempotent
    left = {e.volume.volume_id for e in plugin.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries}
    assert v2.volume_id not in left and v3.volume_id in left


def test_addons_identity_advertises_only_what_works(plugin):
    stub = identity_pb2_grpc.IdentityStub(plugin.channel)
    assert stub.GetIdentity(identity_pb2.GetIdentityRequest()).name == "csi.drsvc.io"
    assert stub.Probe(identity_pb2.ProbeRequest()).ready.value is True
    caps = stub.GetCapabilities(identity_pb2.GetCapabilitiesRequest()).capabilities
    kinds = {c.WhichOneof("type") for c in caps}
    # without a site config there are no workers: replication is neither served nor advertised
    assert "volume_replication" not in kinds
    VGT = identity_pb2.Capability.VolumeGroup
    vg = {c.volume_group.type for c in caps if c.WhichOneof("type") == "volume_group"}
    assert VGT.DO_NOT_ALLOW_VG_TO_DELETE_VOLUMES not in vg and VGT.MODIFY_VOLUME_GROUP in vg
    from csi_plugin.gen import replication_pb2, replication_pb2_grpc
    with pytest.raises(grpc.RpcError) as e:
        replication_pb2_grpc.ControllerStub(plugin.channel).EnableVolumeReplication(
            replication_pb2.EnableVolumeReplicationRequest(volume_id="vol-x"))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # the csi-addons manager then reports only that the driver "does not support VolumeReplication"
    # (kubernetes-csi-addons internal/controller/replication.storage/volumereplication_controller.go):
    # the plugin's own log says why, where `kubectl logs` shows it
    log = plugin.log_path.read_text(errors="replace")
    assert "asked for its CSI-Addons capabilities: replication is off" in log
    assert "started without a site config (--config or DRSVC_CONFIG)" in log


# The parameters kubernetes-csi-addons' VolumeGroupReplicationContent controller passes to
# CreateVolumeGroup: the VolumeGroupReplicationClass's, replication.storage.openshift.io/* stripped
# (internal/controller/replication.storage/volumegroupreplicationcontent_controller.go, Reconcile).
VGR_CLASS = {"schedulingInterval": "5m", "bandwidthLimit": "1000000", "peer": "b",
             "replication.storage.openshift.io/group-replication-secret-name": "s"}


def test_create_group_with_class_parameters_and_members(plugin, groups):
    vols = [plugin.create(f"cm{i}", 32 << 20).volume_id for i in range(3)]
    req = VG.CreateVolumeGroupRequest(name="vgr-1", parameters=VGR_CLASS, volume_ids=vols[:2])
    g = groups.CreateVolumeGroup(req).volume_group
    assert sorted(v.volume_id for v in g.volumes) == sorted(vols[:2])           # field 4 honoured
    assert groups.CreateVolumeGroup(req).volume_group.volume_group_id == g.volume_group_id
    assert _code(lambda: groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(
        name="vgr-1", parameters=VGR_CLASS, volume_ids=vols))) == grpc.StatusCode.ALREADY_EXISTS
    # a bad member leaves no group behind
    assert _code(lambda: groups.CreateVolumeGroup(VG.CreateVolumeGroupRequest(
        name="vgr-2", volume_ids=[vols[2], "vol-missing"]))) == grpc.StatusCode.NOT_FOUND
    assert not any(e.volume_group.volume_group_context["name"] == "vgr-2"
                   for e in groups.ListVolumeGroups(VG.ListVolumeGroupsRequest()).entries)
    # Modify carries the class parameters too (field 4): accepted; maxVolumes applies
    m = groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=g.volume_group_id, volume_ids=vols, parameters=VGR_CLASS)).volume_group
    assert sorted(v.volume_id for v in m.volumes) == sorted(vols)
    assert _code(lambda: groups.ModifyVolumeGroupMembership(VG.ModifyVolumeGroupMembershipRequest(
        volume_group_id=g.volume_group_id, volume_ids=vols, parameters={"maxVolumes": "2"}))) \
        == grpc.StatusCode.RESOURCE_EXHAUSTED
