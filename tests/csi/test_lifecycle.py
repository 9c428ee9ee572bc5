"""A volume's whole life through real gRPC: data written once survives stage,
snapshot, restore, clone, online expansion and plugin restarts."""
from __future__ import annotations

import hashlib
import os
import random
import signal
from pathlib import Path

import grpc
import pytest

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import GiB, MiB, capability, has_cap_sys_resource

KINDS = ["ext4", "xfs", "block"]
DATA = 64 * MiB
SIZE = 512 * MiB           # above mkfs.xfs's 300 MiB floor


def pattern(seed: int, n: int = DATA) -> bytes:
    return random.Random(seed).randbytes(n)


def write_pattern(kind: str, target: Path, data: bytes) -> None:
    path = target if kind == "block" else target / "data.bin"
    flags = os.O_WRONLY | (0 if kind == "block" else os.O_CREAT | os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_sha(kind: str, target: Path, n: int = DATA) -> str:
    path = target if kind == "block" else target / "data.bin"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(n)).hexdigest()


def fs_size(kind: str, target: Path) -> int:
    if kind == "block":
        with open(target, "rb") as f:
            return f.seek(0, os.SEEK_END)
    st = os.statvfs(target)
    return st.f_blocks * st.f_frsize


def source_snapshot(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    src = csi_pb2.VolumeContentSource()
    src.snapshot.snapshot_id = snapshot_id
    return src


def source_volume(volume_id: str) -> csi_pb2.VolumeContentSource:
    src = csi_pb2.VolumeContentSource()
    src.volume.volume_id = volume_id
    return src


def attach(plugin, vol_id, kind, staging, target, **kw):
    plugin.stage(vol_id, staging, kind)
    plugin.publish(vol_id, staging, target, kind, **kw)


def detach(plugin, vol_id, staging, target):
    plugin.unpublish(vol_id, target)
    plugin.unstage(vol_id, staging)


@pytest.mark.parametrize("kind", KINDS)
def test_full_lifecycle(plugin, paths, kind):
    data = pattern(1)
    want = hashlib.sha256(data).hexdigest()
    vol = plugin.create(f"life-{kind}", SIZE, kind)
    assert vol.capacity_bytes >= SIZE
    staging, target = paths("a")

    attach(plugin, vol.volume_id, kind, staging, target)
    write_pattern(kind, target, data)
    assert read_sha(kind, target) == want
    detach(plugin, vol.volume_id, staging, target)
    assert not os.path.exists(target), "the spec asks the plugin to remove the target"

    snap = plugin.snapshot(f"snap-{kind}", vol.volume_id)
    assert snap.ready_to_use and snap.source_volume_id == vol.volume_id

    # restore and clone must each carry the data written before the snapshot
    restored = plugin.create(f"restored-{kind}", SIZE, kind, source=source_snapshot(snap.snapshot_id))
    clone = plugin.create(f"clone-{kind}", SIZE, kind, source=source_volume(vol.volume_id))
    for copy in (restored, clone):
        s, t = paths(copy.volume_id)
        attach(plugin, copy.volume_id, kind, s, t)
        assert read_sha(kind, t) == want
        detach(plugin, copy.volume_id, s, t)

    # the copies are independent: overwriting the clone leaves the origin alone
    s, t = paths("clone-rw")
    attach(plugin, clone.volume_id, kind, s, t)
    write_pattern(kind, t, pattern(2))
    detach(plugin, clone.volume_id, s, t)

    for v in (clone, restored, vol):
        plugin.delete(v.volume_id)
    plugin.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    assert sorted(os.listdir(plugin.pool / "images")) == []
    assert sorted(os.listdir(plugin.pool / "snapshots")) == []


@pytest.mark.parametrize("kind", KINDS)
def test_online_expansion(plugin, paths, kind):
    offline_only = kind == "ext4" and not has_cap_sys_resource()
    data = pattern(4)
    want = hashlib.sha256(data).hexdigest()
    vol = plugin.create(f"grow-{kind}", SIZE, kind)
    staging, target = paths("g")
    attach(plugin, vol.volume_id, kind, staging, target)
    write_pattern(kind, target, data)
    before = fs_size(kind, target)
    grown = plugin.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=GiB),
        volume_capability=capability(kind)), timeout=60)
    assert grown.capacity_bytes >= GiB and grown.node_expansion_required
    expand = csi_pb2.NodeExpandVolumeRequest(
        volume_id=vol.volume_id, volume_path=str(target), staging_target_path=str(staging),
        capacity_range=csi_pb2.CapacityRange(required_bytes=GiB), volume_capability=capability(kind))
    if offline_only:
        # without CAP_SYS_RESOURCE the kernel refuses an online ext4 grow: the spec's answer
        # is FAILED_PRECONDITION, and the next stage grows it offline
        with pytest.raises(grpc.RpcError) as err:
            plugin.node.NodeExpandVolume(expand, timeout=120)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "CAP_SYS_RESOURCE" in err.value.details()
        detach(plugin, vol.volume_id, staging, target)
        attach(plugin, vol.volume_id, kind, staging, target)
    else:
        resp = plugin.node.NodeExpandVolume(expand, timeout=120)
        assert resp.capacity_bytes >= GiB
    after = fs_size(kind, target)
    assert after > before + (GiB - SIZE) // 2, (before, after)
    if kind == "block":
        assert after == GiB
    assert read_sha(kind, target) == want
    detach(plugin, vol.volume_id, staging, target)

    plugin.delete(vol.volume_id)


@pytest.mark.parametrize("kind", ["ext4", "block"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_restart_mid_lifecycle(plugin, paths, kind, sig):
    """Killed after stage and again after publish: re-issuing the RPCs converges."""
    data = pattern(3)
    want = hashlib.sha256(data).hexdigest()
    vol = plugin.create(f"restart-{kind}", SIZE, kind)
    staging, target = paths("r")

    plugin.stage(vol.volume_id, staging, kind)
    plugin.restart(sig)
    plugin.stage(vol.volume_id, staging, kind)          # same answer after the restart
    plugin.publish(vol.volume_id, staging, target, kind)
    write_pattern(kind, target, data)
    plugin.restart(sig)
    plugin.stage(vol.volume_id, staging, kind)
    plugin.publish(vol.volume_id, staging, target, kind)
    assert read_sha(kind, target) == want
    detach(plugin, vol.volume_id, staging, target)

    snap = plugin.snapshot(f"restart-snap-{kind}", vol.volume_id)
    plugin.restart(sig)
    assert plugin.snapshot(f"restart-snap-{kind}", vol.volume_id).snapshot_id == snap.snapshot_id
    copy = plugin.create(f"restart-copy-{kind}", SIZE, kind, source=source_snapshot(snap.snapshot_id))
    s, t = paths("copy")
    attach(plugin, copy.volume_id, kind, s, t)
    assert read_sha(kind, t) == want
    detach(plugin, copy.volume_id, s, t)
