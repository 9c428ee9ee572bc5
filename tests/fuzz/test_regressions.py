"""Inputs the fuzzers found that crashed an RPC or the receiver, kept as explicit cases."""
from __future__ import annotations

import grpc
import pytest

from csi_plugin.gen import csi_pb2

C = grpc.StatusCode
PB = csi_pb2


def _code(fn):
    try:
        fn()
    except grpc.RpcError as e:
        assert e.details()
        return e.code()
    return C.OK


def _cap(mode):
    return PB.VolumeCapability(mount=PB.VolumeCapability.MountVolume(fs_type="ext4"),
                               access_mode=PB.VolumeCapability.AccessMode(mode=mode))


@pytest.mark.parametrize("mode", [-1, 8, 99, 2**31 - 1])
def test_undefined_access_mode_is_invalid_argument(plugin, paths, mode):
    """proto3 enums are open: an access mode number the proto does not define was INTERNAL
    (ValueError from Mode.Name) in every RPC taking a capability."""
    vol = plugin.create("regress-mode").volume_id
    staging, target = paths()
    cap = _cap(mode)
    calls = {
        "CreateVolume": lambda: plugin.controller.CreateVolume(PB.CreateVolumeRequest(
            name="m", volume_capabilities=[cap]), timeout=30),
        "ValidateVolumeCapabilities": lambda: plugin.controller.ValidateVolumeCapabilities(
            PB.ValidateVolumeCapabilitiesRequest(volume_id=vol, volume_capabilities=[cap]), timeout=30),
        "GetCapacity": lambda: plugin.controller.GetCapacity(
            PB.GetCapacityRequest(volume_capabilities=[cap]), timeout=30),
        "NodeStageVolume": lambda: plugin.node.NodeStageVolume(PB.NodeStageVolumeRequest(
            volume_id=vol, staging_target_path=str(staging), volume_capability=cap), timeout=30),
        "NodePublishVolume": lambda: plugin.node.NodePublishVolume(PB.NodePublishVolumeRequest(
            volume_id=vol, staging_target_path=str(staging), target_path=str(target),
            volume_capability=cap), timeout=30),
    }
    got = {name: _code(fn) for name, fn in calls.items()}
    assert set(got.values()) == {C.INVALID_ARGUMENT}, got
    assert plugin.probe()
