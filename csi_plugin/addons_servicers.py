"""CSI-Addons Identity, VolumeGroup and Replication servicers: convert, call the core."""
from __future__ import annotations

from google.protobuf.duration_pb2 import Duration

import drsvc
from drsvc.errors import InvalidInput

from . import convert
from .csi_servicers import DRIVER_NAME
from .errors import rpc
from .gen import (identity_pb2, identity_pb2_grpc, replication_pb2, replication_pb2_grpc,
                  volumegroup_pb2, volumegroup_pb2_grpc)

Cap = identity_pb2.Capability
VG = Cap.VolumeGroup
# Only what works: no DO_NOT_ALLOW_VG_TO_DELETE_VOLUMES (deleting a group deletes its volumes).
GROUP_CAPS = [VG.VOLUME_GROUP, VG.LIMIT_VOLUME_TO_ONE_VOLUME_GROUP, VG.MODIFY_VOLUME_GROUP,
              VG.GET_VOLUME_GROUP, VG.LIST_VOLUME_GROUPS]


class AddonsIdentity(identity_pb2_grpc.IdentityServicer):
    def __init__(self, site, replication_enabled: bool):
        self.site = site
        self.replication_enabled = replication_enabled

    @rpc
    def GetIdentity(self, req, context):
        return identity_pb2.GetIdentityResponse(name=DRIVER_NAME, vendor_version=drsvc.__version__,
                                                manifest={"site": self.site.pool.site})

    @rpc
    def GetCapabilities(self, req, context):
        caps = [Cap(service=Cap.Service(type=Cap.Service.CONTROLLER_SERVICE))]
        if self.replication_enabled:
            caps.append(Cap(volume_replication=Cap.VolumeReplication(
                type=Cap.VolumeReplication.VOLUME_REPLICATION)))
        caps += [Cap(volume_group=VG(type=t)) for t in GROUP_CAPS]
        return identity_pb2.GetCapabilitiesResponse(capabilities=caps)

    @rpc
    def Probe(self, req, context):
        self.site.pool.space()
        resp = identity_pb2.ProbeResponse()
        resp.ready.value = True
        return resp


def _group(site, g) -> volumegroup_pb2.VolumeGroup:
    vols = [v for vid in g.volume_ids if (v := site.volumes.find_volume(vid)) is not None]
    return volumegroup_pb2.VolumeGroup(volume_group_id=g.group_id,
                                       volume_group_context={"name": g.name},
                                       volumes=[convert.volume(v) for v in vols])


class VolumeGroupController(volumegroup_pb2_grpc.ControllerServicer):
    def __init__(self, site):
        self.site = site

    @rpc
    def CreateVolumeGroup(self, req, context):
        self.site.check_secrets(dict(req.secrets))
        g = self.site.groups.create(req.name, dict(req.parameters))
        return volumegroup_pb2.CreateVolumeGroupResponse(volume_group=_group(self.site, g))

    @rpc
    def ModifyVolumeGroupMembership(self, req, context):
        self.site.check_secrets(dict(req.secrets))
        g = self.site.groups.modify(req.volume_group_id, list(req.volume_ids))
        return volumegroup_pb2.ModifyVolumeGroupMembershipResponse(volume_group=_group(self.site, g))

    @rpc
    def DeleteVolumeGroup(self, req, context):
        self.site.check_secrets(dict(req.secrets))
        self.site.delete_group(req.volume_group_id)
        return volumegroup_pb2.DeleteVolumeGroupResponse()

    @rpc
    def ListVolumeGroups(self, req, context):
        self.site.check_secrets(dict(req.secrets))
        page = self.site.groups.list(req.max_entries, req.starting_token)
        E = volumegroup_pb2.ListVolumeGroupsResponse.Entry
        return volumegroup_pb2.ListVolumeGroupsResponse(
            next_token=page.next_token, entries=[E(volume_group=_group(self.site, g)) for g in page.items])

    @rpc
    def ControllerGetVolumeGroup(self, req, context):
        self.site.check_secrets(dict(req.secrets))
        g = self.site.groups.get(req.volume_group_id)
        return volumegroup_pb2.ControllerGetVolumeGroupResponse(volume_group=_group(self.site, g))


def source_of(req) -> tuple[str, str]:
    """(kind, id) from either the seed's volume_id or the sidecar's replication_source."""
    if req.HasField("replication_source"):
        src = req.replication_source
        which = src.WhichOneof("type")
        if which == "volume" and src.volume.volume_id:
            return "volume", src.volume.volume_id
        if which == "volumegroup" and src.volumegroup.volume_group_id:
            return "group", src.volumegroup.volume_group_id
    if req.volume_id:
        return "volume", req.volume_id
    raise InvalidInput("volume_id or replication_source is required")


class ReplicationController(replication_pb2_grpc.ControllerServicer):
    def __init__(self, site, replication, status):
        self.site = site
        self.replication = replication    # drsvc.replication.requests
        self.status = status              # drsvc.replication.status

    def _unit(self, req):
        self.site.check_secrets(dict(req.secrets))
        return self.status.resolve(*source_of(req))

    @rpc
    def EnableVolumeReplication(self, req, context):
        self.replication.enable(self._unit(req), dict(req.parameters))
        return replication_pb2.EnableVolumeReplicationResponse()

    @rpc
    def DisableVolumeReplication(self, req, context):
        self.replication.disable(self._unit(req), dict(req.parameters))
        return replication_pb2.DisableVolumeReplicationResponse()

    @rpc
    def PromoteVolume(self, req, context):
        self.replication.promote(self._unit(req), force=req.force)
        return replication_pb2.PromoteVolumeResponse()

    @rpc
    def DemoteVolume(self, req, context):
        self.replication.demote(self._unit(req), force=req.force)
        return replication_pb2.DemoteVolumeResponse()

    @rpc
    def ResyncVolume(self, req, context):
        ready = self.replication.resync(self._unit(req), force=req.force)
        return replication_pb2.ResyncVolumeResponse(ready=ready)

    @rpc
    def GetVolumeReplicationInfo(self, req, context):
        info = self.status.info(self._unit(req))
        R = replication_pb2.GetVolumeReplicationInfoResponse
        resp = R(last_sync_bytes=info.last_sync_bytes, status=R.Status.Value(info.status),
                 status_message=info.status_message)
        if info.last_sync_time:
            resp.last_sync_time.CopyFrom(convert.timestamp(info.last_sync_time))
            d = Duration()
            d.FromNanoseconds(int(info.last_sync_duration * 1e9))
            resp.last_sync_duration.CopyFrom(d)
        return resp
