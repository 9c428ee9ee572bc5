"""CSI-Addons Identity, VolumeGroup and Replication servicers: convert, call the core."""
from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf.duration_pb2 import Duration

import drsvc
from drsvc.controller_api import Controller, ReplicationControl
from drsvc.errors import DrsvcError, MissingField

from . import convert
from .csi_servicers import DRIVER_NAME
from .errors import code_for, rpc
from .gen import (identity_pb2, identity_pb2_grpc, replication_pb2, replication_pb2_grpc,
                  volumegroup_pb2, volumegroup_pb2_grpc)

log = logging.getLogger(__name__)
Cap = identity_pb2.Capability
# what a user finds in the plugin's log when a VolumeReplication gets no status: the csi-addons
# manager only says the driver "does not support VolumeReplication"
NO_REPLICATION = ("replication is off: the plugin was started without a site config (--config or "
                  "DRSVC_CONFIG), so it does not offer VolumeReplication to the csi-addons controller; "
                  "a VolumeReplication or VolumeGroupReplication for this driver gets no status")
VG = Cap.VolumeGroup
# Only what works: no DO_NOT_ALLOW_VG_TO_DELETE_VOLUMES (deleting a group deletes its volumes).
GROUP_CAPS = [VG.VOLUME_GROUP, VG.LIMIT_VOLUME_TO_ONE_VOLUME_GROUP, VG.MODIFY_VOLUME_GROUP,
              VG.GET_VOLUME_GROUP, VG.LIST_VOLUME_GROUPS]


class AddonsIdentity(identity_pb2_grpc.IdentityServicer):
    """*ctl* is the plugin's controller: its site name and its probe."""

    def __init__(self, ctl: Controller, replication_enabled: bool):
        self.ctl = ctl
        self.replication_enabled = replication_enabled
        self.said_why = False             # once a process: the sidecar asks again on each reconnect

    @rpc
    def GetIdentity(self, req, context):
        return identity_pb2.GetIdentityResponse(name=DRIVER_NAME, vendor_version=drsvc.__version__,
                                                manifest={"site": self.ctl.site_name})

    @rpc
    def GetCapabilities(self, req, context):
        caps = [Cap(service=Cap.Service(type=Cap.Service.CONTROLLER_SERVICE))]
        if not self.replication_enabled and not self.said_why:
            self.said_why = True
            log.warning("asked for its CSI-Addons capabilities: %s", NO_REPLICATION)
        if self.replication_enabled:
            caps.append(Cap(volume_replication=Cap.VolumeReplication(
                type=Cap.VolumeReplication.VOLUME_REPLICATION)))
        caps += [Cap(volume_group=VG(type=t)) for t in GROUP_CAPS]
        return identity_pb2.GetCapabilitiesResponse(capabilities=caps)

    @rpc
    def Probe(self, req, context):
        self.ctl.probe()
        resp = identity_pb2.ProbeResponse()
        resp.ready.value = True
        return resp


def _group(view) -> volumegroup_pb2.VolumeGroup:
    g = view.group
    return volumegroup_pb2.VolumeGroup(volume_group_id=g.group_id,
                                       volume_group_context={"name": g.name},
                                       volumes=[convert.volume(v) for v in view.volumes])


class VolumeGroupController(volumegroup_pb2_grpc.ControllerServicer):
    """*ctl* is the plugin's controller (drsvc.controller_api.Controller: PoolController, or
    ClusterController on a multi-node site); *check_secrets* the config's."""

    def __init__(self, ctl: Controller, check_secrets):
        self.ctl = ctl
        self.check_secrets = check_secrets

    @rpc
    def CreateVolumeGroup(self, req, context):
        self.check_secrets(dict(req.secrets))
        view = self.ctl.create_group(req.name, dict(req.parameters), list(req.volume_ids))
        return volumegroup_pb2.CreateVolumeGroupResponse(volume_group=_group(view))

    @rpc
    def ModifyVolumeGroupMembership(self, req, context):
        self.check_secrets(dict(req.secrets))
        view = self.ctl.modify_group(req.volume_group_id, list(req.volume_ids), dict(req.parameters))
        return volumegroup_pb2.ModifyVolumeGroupMembershipResponse(volume_group=_group(view))

    @rpc
    def DeleteVolumeGroup(self, req, context):
        self.check_secrets(dict(req.secrets))
        self.ctl.delete_group(req.volume_group_id)
        return volumegroup_pb2.DeleteVolumeGroupResponse()

    @rpc
    def ListVolumeGroups(self, req, context):
        self.check_secrets(dict(req.secrets))
        page = self.ctl.list_groups(req.max_entries, req.starting_token)
        E = volumegroup_pb2.ListVolumeGroupsResponse.Entry
        return volumegroup_pb2.ListVolumeGroupsResponse(
            next_token=page.next_token, entries=[E(volume_group=_group(v)) for v in page.items])

    @rpc
    def ControllerGetVolumeGroup(self, req, context):
        self.check_secrets(dict(req.secrets))
        view = self.ctl.get_group(req.volume_group_id)
        return volumegroup_pb2.ControllerGetVolumeGroupResponse(volume_group=_group(view))


log = logging.getLogger(__name__)
C = grpc.StatusCode
# The replication seed's error table of each RPC (003). A condition it does not list is
# answered UNKNOWN ("study the logs"): the seed has no INTERNAL, and Enable/Disable no
# FAILED_PRECONDITION, and the controller reads these codes literally.
_COMMON = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.ABORTED, C.UNAUTHENTICATED, C.UNKNOWN}
SEED_CODES = {
    "EnableVolumeReplication": _COMMON,
    "DisableVolumeReplication": _COMMON,
    "PromoteVolume": _COMMON | {C.FAILED_PRECONDITION, C.UNIMPLEMENTED},
    "DemoteVolume": _COMMON | {C.FAILED_PRECONDITION, C.UNIMPLEMENTED},
    "ResyncVolume": _COMMON | {C.FAILED_PRECONDITION, C.UNIMPLEMENTED},
    "GetVolumeReplicationInfo": _COMMON | {C.FAILED_PRECONDITION, C.UNIMPLEMENTED},
}


def seed_codes(method):
    """Answer codes outside the RPC's seed table as UNKNOWN (used under @rpc)."""
    allowed = SEED_CODES[method.__name__]

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except DrsvcError as e:
            code = code_for(e)
            if code in allowed:
                raise
            log.error("%s failed (%s, answered UNKNOWN as the seed lists): %s", method.__name__, code.name, e)
            context.abort(C.UNKNOWN, e.message)
    return wrapper


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
    raise MissingField(field="volume_id or replication_source")


class ReplicationController(replication_pb2_grpc.ControllerServicer):
    """*api* answers by (kind, id) (drsvc.controller_api.ReplicationControl):
    drsvc.replication.control.api.ReplicationAPI over a pool, or drsvc.cluster.ClusterReplication
    on a multi-node site's controller. *check_secrets* is the site config's."""

    def __init__(self, api: ReplicationControl, check_secrets):
        self.api = api
        self.check_secrets = check_secrets

    def _unit(self, req) -> tuple[str, str]:
        self.check_secrets(dict(req.secrets))
        return source_of(req)

    @rpc
    @seed_codes
    def EnableVolumeReplication(self, req, context):
        self.api.enable(*self._unit(req), dict(req.parameters))
        return replication_pb2.EnableVolumeReplicationResponse()

    @rpc
    @seed_codes
    def DisableVolumeReplication(self, req, context):
        self.api.disable(*self._unit(req), dict(req.parameters))
        return replication_pb2.DisableVolumeReplicationResponse()

    @rpc
    @seed_codes
    def PromoteVolume(self, req, context):
        self.api.promote(*self._unit(req), req.force, dict(req.parameters))
        return replication_pb2.PromoteVolumeResponse()

    @rpc
    @seed_codes
    def DemoteVolume(self, req, context):
        self.api.demote(*self._unit(req), req.force)
        return replication_pb2.DemoteVolumeResponse()

    @rpc
    @seed_codes
    def ResyncVolume(self, req, context):
        ready = self.api.resync(*self._unit(req), req.force)
        return replication_pb2.ResyncVolumeResponse(ready=ready)

    @rpc
    @seed_codes
    def GetVolumeReplicationInfo(self, req, context):
        info = self.api.info(*self._unit(req))
        R = replication_pb2.GetVolumeReplicationInfoResponse
        resp = R(last_sync_bytes=info.last_sync_bytes, status=R.Status.Value(info.status),
                 status_message=info.status_message)
        if info.last_sync_time:
            resp.last_sync_time.CopyFrom(convert.timestamp(info.last_sync_time))
            d = Duration()
            d.FromNanoseconds(int(info.last_sync_duration * 1e9))
            resp.last_sync_duration.CopyFrom(d)
        return resp
