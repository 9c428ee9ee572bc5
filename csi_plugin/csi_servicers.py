"""CSI v1 Identity, Controller and Node servicers: convert, call the core, convert back."""
from __future__ import annotations

import drsvc
from drsvc.controller_api import Controller as ControllerAPI
from drsvc.ids import check_id, check_map
from drsvc.errors import MissingField
from drsvc.site import Site

from . import convert
from .errors import rpc
from .gen import csi_pb2, csi_pb2_grpc

DRIVER_NAME = "csi.drsvc.io"
CCap = csi_pb2.ControllerServiceCapability.RPC.Type
NCap = csi_pb2.NodeServiceCapability.RPC.Type
CONTROLLER_CAPS = [CCap.CREATE_DELETE_VOLUME, CCap.LIST_VOLUMES, CCap.GET_CAPACITY,
                   CCap.CREATE_DELETE_SNAPSHOT, CCap.LIST_SNAPSHOTS, CCap.CLONE_VOLUME,
                   CCap.EXPAND_VOLUME, CCap.VOLUME_CONDITION, CCap.GET_VOLUME,
                   CCap.SINGLE_NODE_MULTI_WRITER, CCap.GET_SNAPSHOT, CCap.MODIFY_VOLUME]
NODE_CAPS = [NCap.STAGE_UNSTAGE_VOLUME, NCap.GET_VOLUME_STATS, NCap.EXPAND_VOLUME,
             NCap.VOLUME_CONDITION, NCap.SINGLE_NODE_MULTI_WRITER]


def _secrets(req) -> None:
    if hasattr(req, "secrets"):
        check_map(dict(req.secrets), "secrets")


PService = csi_pb2.PluginCapability.Service.Type
# a one-node site's plugin serves every service; a multi-node site, only these: its controller
# has no SnapshotMetadata, and its node plugins advertise what the site serves (a CO sends
# controller calls to the controller's endpoint, never to a node's)
POOL_SERVICES = (PService.CONTROLLER_SERVICE, PService.VOLUME_ACCESSIBILITY_CONSTRAINTS,
                 PService.GROUP_CONTROLLER_SERVICE, PService.SNAPSHOT_METADATA_SERVICE)
CLUSTER_SERVICES = (PService.CONTROLLER_SERVICE, PService.VOLUME_ACCESSIBILITY_CONSTRAINTS,
                    PService.GROUP_CONTROLLER_SERVICE)


class Identity(csi_pb2_grpc.IdentityServicer):
    """*ctl* is the plugin's controller: its site name, and its probe."""

    def __init__(self, ctl: ControllerAPI, services=POOL_SERVICES):
        self.ctl = ctl
        self.services = services

    @rpc
    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=drsvc.__version__,
                                             manifest={"site": self.ctl.site_name})

    @rpc
    def GetPluginCapabilities(self, request, context):
        P = csi_pb2.PluginCapability
        return csi_pb2.GetPluginCapabilitiesResponse(
            capabilities=[P(service=P.Service(type=t)) for t in self.services]
            + [P(volume_expansion=P.VolumeExpansion(type=P.VolumeExpansion.ONLINE))])

    @rpc
    def Probe(self, request, context):
        self.ctl.probe()             # the pool (or a storage node) must be reachable
        resp = csi_pb2.ProbeResponse()
        resp.ready.value = True
        return resp


class Controller(csi_pb2_grpc.ControllerServicer):
    """CSI Controller over the controller contract (drsvc.controller_api.Controller): the
    pool of a one-node site (PoolController) or the storage nodes of a multi-node site
    (cluster.ClusterController)."""

    def __init__(self, ctl: ControllerAPI):
        self.ctl = ctl

    @rpc
    def CreateVolume(self, req, context):
        _secrets(req)
        reqs = req.accessibility_requirements
        vol = self.ctl.create_volume(
            req.name, required_bytes=req.capacity_range.required_bytes,
            limit_bytes=req.capacity_range.limit_bytes,
            capabilities=convert.capabilities(req.volume_capabilities),
            parameters=dict(req.parameters), source=convert.content_source(req),
            requisite=convert.topologies(reqs.requisite), preferred=convert.topologies(reqs.preferred),
            mutable=dict(req.mutable_parameters))
        return csi_pb2.CreateVolumeResponse(volume=convert.volume(vol))

    @rpc
    def DeleteVolume(self, req, context):
        _secrets(req)
        self.ctl.delete_volume(req.volume_id)
        return csi_pb2.DeleteVolumeResponse()

    @rpc
    def ValidateVolumeCapabilities(self, req, context):
        _secrets(req)
        problem = self.ctl.validate(req.volume_id, convert.capabilities(req.volume_capabilities),
                                    dict(req.parameters))
        if problem:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message=problem)
        return csi_pb2.ValidateVolumeCapabilitiesResponse(
            confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=req.volume_context, volume_capabilities=req.volume_capabilities,
                parameters=req.parameters))

    @staticmethod
    def _status(st, cls):
        return cls(published_node_ids=st.published_node_ids,
                   volume_condition=csi_pb2.VolumeCondition(abnormal=bool(st.problem),
                                                            message=st.problem or "volume is healthy"))

    @rpc
    def ListVolumes(self, req, context):
        page = self.ctl.list_volumes(req.max_entries, req.starting_token)
        R = csi_pb2.ListVolumesResponse
        return R(next_token=page.next_token, entries=[
            R.Entry(volume=convert.volume(st.volume), status=self._status(st, R.VolumeStatus))
            for st in page.items])

    @rpc
    def ControllerGetVolume(self, req, context):
        st = self.ctl.get_volume(req.volume_id)
        R = csi_pb2.ControllerGetVolumeResponse
        return R(volume=convert.volume(st.volume), status=self._status(st, R.VolumeStatus))

    @rpc
    def GetCapacity(self, req, context):
        cap = self.ctl.capacity(
            dict(req.accessible_topology.segments) if req.HasField("accessible_topology") else None,
            convert.capabilities(req.volume_capabilities), dict(req.parameters))
        resp = csi_pb2.GetCapacityResponse(available_capacity=cap.available)
        resp.maximum_volume_size.value = cap.maximum
        resp.minimum_volume_size.value = cap.minimum
        return resp

    @rpc
    def ControllerGetCapabilities(self, req, context):
        C = csi_pb2.ControllerServiceCapability
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[C(rpc=C.RPC(type=t)) for t in CONTROLLER_CAPS])

    @rpc
    def CreateSnapshot(self, req, context):
        _secrets(req)
        if not req.source_volume_id:
            raise MissingField(field="source_volume_id")
        snap = self.ctl.create_snapshot(req.name, req.source_volume_id, dict(req.parameters))
        return csi_pb2.CreateSnapshotResponse(snapshot=convert.snapshot(snap))

    @rpc
    def DeleteSnapshot(self, req, context):
        _secrets(req)
        self.ctl.delete_snapshot(req.snapshot_id)
        return csi_pb2.DeleteSnapshotResponse()

    @rpc
    def GetSnapshot(self, req, context):
        _secrets(req)
        return csi_pb2.GetSnapshotResponse(snapshot=convert.snapshot(self.ctl.get_snapshot(req.snapshot_id)))

    @rpc
    def ControllerModifyVolume(self, req, context):
        _secrets(req)
        self.ctl.modify_volume(req.volume_id, dict(req.mutable_parameters))
        return csi_pb2.ControllerModifyVolumeResponse()

    @rpc
    def ListSnapshots(self, req, context):
        _secrets(req)
        page = self.ctl.list_snapshots(req.max_entries, req.starting_token, req.snapshot_id,
                                       req.source_volume_id)
        E = csi_pb2.ListSnapshotsResponse.Entry
        return csi_pb2.ListSnapshotsResponse(next_token=page.next_token,
                                             entries=[E(snapshot=convert.snapshot(s)) for s in page.items])

    @rpc
    def ControllerExpandVolume(self, req, context):
        _secrets(req)
        size = self.ctl.expand_volume(req.volume_id, req.capacity_range.required_bytes,
                                      req.capacity_range.limit_bytes)
        return csi_pb2.ControllerExpandVolumeResponse(capacity_bytes=size, node_expansion_required=True)


class Node(csi_pb2_grpc.NodeServicer):
    def __init__(self, site: Site):
        self.site = site

    @rpc
    def NodeStageVolume(self, req, context):
        _secrets(req)
        self.site.node.stage(req.volume_id, req.staging_target_path,
                             convert.optional_capability(req))
        return csi_pb2.NodeStageVolumeResponse()

    @rpc
    def NodeUnstageVolume(self, req, context):
        self.site.node.unstage(req.volume_id, req.staging_target_path)
        return csi_pb2.NodeUnstageVolumeResponse()

    @rpc
    def NodePublishVolume(self, req, context):
        _secrets(req)
        self.site.node.publish(req.volume_id, req.target_path, req.staging_target_path,
                               convert.optional_capability(req), req.readonly)
        return csi_pb2.NodePublishVolumeResponse()

    @rpc
    def NodeUnpublishVolume(self, req, context):
        self.site.node.unpublish(req.volume_id, req.target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @rpc
    def NodeGetVolumeStats(self, req, context):
        st = self.site.node.stats(req.volume_id, req.volume_path)
        U = csi_pb2.VolumeUsage
        usage = [U(unit=U.BYTES, total=st.total_bytes, available=st.available_bytes, used=st.used_bytes)]
        if not st.block and not st.abnormal:
            usage.append(U(unit=U.INODES, total=st.total_inodes, available=st.available_inodes,
                           used=st.used_inodes))
        return csi_pb2.NodeGetVolumeStatsResponse(
            usage=usage, volume_condition=csi_pb2.VolumeCondition(abnormal=st.abnormal, message=st.message))

    @rpc
    def NodeExpandVolume(self, req, context):
        _secrets(req)
        check_id(req.volume_id)
        size = self.site.node.expand(req.volume_id, req.volume_path, req.capacity_range.required_bytes,
                                     req.capacity_range.limit_bytes)
        return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)

    @rpc
    def NodeGetCapabilities(self, req, context):
        C = csi_pb2.NodeServiceCapability
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[C(rpc=C.RPC(type=t)) for t in NODE_CAPS])

    @rpc
    def NodeGetInfo(self, req, context):
        from drsvc.node import MAX_VOLUMES_PER_NODE
        return csi_pb2.NodeGetInfoResponse(
            node_id=self.site.node_id, max_volumes_per_node=MAX_VOLUMES_PER_NODE,
            accessible_topology=csi_pb2.Topology(segments=self.site.volumes.topology))
