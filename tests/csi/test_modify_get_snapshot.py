"""GetSnapshot and ControllerModifyVolume (CSI 1.10 / 1.9), with the spec's error tables.

Callers: external-snapshotter's sidecar calls GetSnapshot for a group member's
status (pkg/snapshotter/snapshotter.go, GetSnapshotStatus); external-resizer's
modify controller sends the VolumeAttributesClass parameters as
mutable_parameters (pkg/modifycontroller/modify_volume.go) and, at creation,
external-provisioner passes them in CreateVolumeRequest.mutable_parameters.
"""
from __future__ import annotations

import os

import grpc
import pytest

from csi_plugin.gen import csi_pb2
from drsvc.store import file_lock
from tests.fixtures.csi import MiB, capability

Code = grpc.StatusCode
CCap = csi_pb2.ControllerServiceCapability.RPC.Type


def code_of(call):
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.details(), "every error carries a human message"
    return exc.value.code(), exc.value.details()


def allocated(plugin, volume_id: str) -> int:
    st = os.stat(plugin.pool / "images" / f"{volume_id}.img")
    return st.st_blocks * 512


def modify(plugin, volume_id, **params):
    return plugin.controller.ControllerModifyVolume(
        csi_pb2.ControllerModifyVolumeRequest(volume_id=volume_id, mutable_parameters=params), timeout=60)


def test_capabilities_advertised(plugin):
    caps = {c.rpc.type for c in plugin.controller.ControllerGetCapabilities(
        csi_pb2.ControllerGetCapabilitiesRequest()).capabilities}
    assert {CCap.GET_SNAPSHOT, CCap.MODIFY_VOLUME} <= caps


def test_get_snapshot(plugin):
    vol = plugin.create("gs-src", 64 * MiB)
    snap = plugin.snapshot("gs-snap", vol.volume_id)
    got = plugin.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)).snapshot
    assert got == snap and got.ready_to_use and got.source_volume_id == vol.volume_id
    assert got.group_snapshot_id == ""
    assert code_of(lambda: plugin.controller.GetSnapshot(csi_pb2.GetSnapshotRequest()))[0] == Code.INVALID_ARGUMENT
    missing = csi_pb2.GetSnapshotRequest(snapshot_id="snap-" + "0" * 24)
    assert code_of(lambda: plugin.controller.GetSnapshot(missing))[0] == Code.NOT_FOUND
    plugin.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    gone = csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)
    assert code_of(lambda: plugin.controller.GetSnapshot(gone))[0] == Code.NOT_FOUND


def test_modify_preallocates_and_is_idempotent(plugin):
    vol = plugin.create("mod", 64 * MiB)
    assert allocated(plugin, vol.volume_id) < 64 * MiB
    modify(plugin, vol.volume_id, preallocate="true")
    assert allocated(plugin, vol.volume_id) >= 64 * MiB
    modify(plugin, vol.volume_id, preallocate="true")          # repeat: same result
    modify(plugin, vol.volume_id)                                # no keys: nothing changes
    assert allocated(plugin, vol.volume_id) >= 64 * MiB
    # the CreateVolume arguments are unchanged, so a repeat still answers the same volume
    assert plugin.create("mod", 64 * MiB) == vol
    modify(plugin, vol.volume_id, preallocate="false")
    doc = (plugin.pool / "volumes" / f"{vol.volume_id}.json").read_text()
    assert '"preallocate": "false"' in doc


def test_modify_error_table(plugin):
    vol = plugin.create("mod-err", 64 * MiB)
    assert code_of(lambda: modify(plugin, "", preallocate="true"))[0] == Code.INVALID_ARGUMENT
    assert code_of(lambda: modify(plugin, "vol-" + "0" * 24, preallocate="true"))[0] == Code.NOT_FOUND
    assert code_of(lambda: modify(plugin, vol.volume_id, XXX_FakeKey="x"))[0] == Code.INVALID_ARGUMENT
    assert code_of(lambda: modify(plugin, vol.volume_id, preallocate="maybe"))[0] == Code.INVALID_ARGUMENT
    for key in ("schedulingInterval", "replication.storage.openshift.io/replication-secret-name"):
        code, msg = code_of(lambda k=key: modify(plugin, vol.volume_id, **{k: "5m", "preallocate": "true"}))
        assert code == Code.INVALID_ARGUMENT and "VolumeReplicationClass" in msg
    # a refused call applied nothing, not even the valid key beside the bad one
    assert allocated(plugin, vol.volume_id) < 64 * MiB
    with file_lock(plugin.pool / "locks" / f"{vol.volume_id}.lock"):
        assert code_of(lambda: modify(plugin, vol.volume_id, preallocate="true"))[0] == Code.ABORTED


def test_create_volume_with_mutable_parameters(plugin):
    def create(name, **mutable):
        return plugin.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MiB),
            volume_capabilities=[capability("ext4")], mutable_parameters=mutable), timeout=60).volume

    vol = create("vac", preallocate="true")
    assert allocated(plugin, vol.volume_id) >= 32 * MiB
    assert create("vac", preallocate="true") == vol
    assert code_of(lambda: create("vac-bad", XXX_FakeKey="x"))[0] == Code.INVALID_ARGUMENT
    names = {v.volume.volume_id for v in plugin.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries}
    assert names == {vol.volume_id}, "a refused CreateVolume created nothing"
