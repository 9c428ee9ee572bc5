"""CSI GroupController: volume group snapshots (one consistent instant across members)."""
from __future__ import annotations

from drsvc.controller_api import Controller
from drsvc.ids import check_map
from drsvc.snapshots import GroupSnapshot

from . import convert
from .errors import rpc
from .gen import csi_pb2, csi_pb2_grpc

GCap = csi_pb2.GroupControllerServiceCapability.RPC.Type
GROUP_CONTROLLER_CAPS = [GCap.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT]


def _group_snapshot(gs: GroupSnapshot, members) -> csi_pb2.VolumeGroupSnapshot:
    snaps = [convert.snapshot(s) for s in members]
    return csi_pb2.VolumeGroupSnapshot(
        group_snapshot_id=gs.group_snapshot_id, snapshots=snaps,
        creation_time=convert.timestamp(gs.created_at),
        ready_to_use=gs.state == "ready" and len(snaps) == len(gs.snapshot_ids)
        and all(s.ready_to_use for s in snaps))


class GroupController(csi_pb2_grpc.GroupControllerServicer):
    """*ctl* is the plugin's controller (drsvc.controller_api.Controller): PoolController, or
    on a multi-node site ClusterController (a group snapshot across nodes is cut in parts)."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl

    @rpc
    def GroupControllerGetCapabilities(self, req, context):
        C = csi_pb2.GroupControllerServiceCapability
        return csi_pb2.GroupControllerGetCapabilitiesResponse(
            capabilities=[C(rpc=C.RPC(type=t)) for t in GROUP_CONTROLLER_CAPS])

    @rpc
    def CreateVolumeGroupSnapshot(self, req, context):
        check_map(dict(req.secrets), "secrets")
        gs, members = self.ctl.create_group_snapshot(req.name, list(req.source_volume_ids), dict(req.parameters))
        return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=_group_snapshot(gs, members))

    @rpc
    def GetVolumeGroupSnapshot(self, req, context):
        check_map(dict(req.secrets), "secrets")
        gs, members = self.ctl.get_group_snapshot(req.group_snapshot_id, list(req.snapshot_ids))
        return csi_pb2.GetVolumeGroupSnapshotResponse(group_snapshot=_group_snapshot(gs, members))

    @rpc
    def DeleteVolumeGroupSnapshot(self, req, context):
        check_map(dict(req.secrets), "secrets")
        self.ctl.delete_group_snapshot(req.group_snapshot_id, list(req.snapshot_ids))
        return csi_pb2.DeleteVolumeGroupSnapshotResponse()
