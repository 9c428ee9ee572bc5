"""Proto <-> core conversions. No decisions here, only translation."""
from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from drsvc.errors import UnsupportedCapability
from drsvc.model import BLOCK, MOUNT, Capability, ContentSource, Snapshot, Volume

from .gen import csi_pb2


def capability(cap: csi_pb2.VolumeCapability) -> Capability:
    which = cap.WhichOneof("access_type")
    modes = csi_pb2.VolumeCapability.AccessMode.Mode
    if cap.access_mode.mode not in modes.values():
        # proto3 enums are open: an undefined number arrives intact and Name() raises
        raise UnsupportedCapability(reason=f"unknown access mode {cap.access_mode.mode}")
    mode = modes.Name(cap.access_mode.mode)
    if which == "mount":
        return Capability(MOUNT, mode, cap.mount.fs_type, tuple(cap.mount.mount_flags))
    if which == "block":
        return Capability(BLOCK, mode)
    return Capability("", mode)


def capabilities(caps) -> list[Capability]:
    return [capability(c) for c in caps]


def optional_capability(msg, field: str = "volume_capability") -> Capability | None:
    return capability(getattr(msg, field)) if msg.HasField(field) else None


def content_source(req) -> ContentSource | None:
    if not req.HasField("volume_content_source"):
        return None
    src = req.volume_content_source
    which = src.WhichOneof("type")
    if which == "snapshot":
        return ContentSource("snapshot", src.snapshot.snapshot_id)
    if which == "volume":
        return ContentSource("volume", src.volume.volume_id)
    return ContentSource("unknown", "")


def topologies(terms) -> list[dict]:
    return [dict(t.segments) for t in terms]


def volume(vol: Volume) -> csi_pb2.Volume:
    out = csi_pb2.Volume(volume_id=vol.volume_id, capacity_bytes=vol.capacity_bytes,
                         accessible_topology=[csi_pb2.Topology(segments=vol.topology)])
    if vol.source:
        if vol.source["kind"] == "snapshot":
            out.content_source.snapshot.snapshot_id = vol.source["source_id"]
        else:
            out.content_source.volume.volume_id = vol.source["source_id"]
    if vol.group_id:
        out.volume_context["drsvc.io/volumeGroup"] = vol.group_id
    return out


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def snapshot(s: Snapshot) -> csi_pb2.Snapshot:
    return csi_pb2.Snapshot(snapshot_id=s.snapshot_id, source_volume_id=s.source_volume_id,
                            size_bytes=s.size_bytes, creation_time=timestamp(s.created_at),
                            ready_to_use=s.state == "ready", group_snapshot_id=s.group_snapshot_id)
