"""GroupController: volume group snapshots at one consistent instant.

Caller: external-snapshotter's group snapshot sidecar
(pkg/group_snapshotter/group_snapshotter.go) calls CreateVolumeGroupSnapshot
with the volume ids, and Get/DeleteVolumeGroupSnapshot with the member
snapshot ids it recorded; members are then read one by one with GetSnapshot
and restored by CreateVolume from their snapshot ids.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import grpc
import pytest

from csi_plugin.gen import csi_pb2, csi_pb2_grpc
from drsvc.ids import name_key
from drsvc.store import file_lock
from drsvc_lab import wait_until
from tests.fixtures.csi import MiB

Code = grpc.StatusCode
PCap = csi_pb2.PluginCapability.Service
GCap = csi_pb2.GroupControllerServiceCapability.RPC.Type


def code_of(call):
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.details(), "every error carries a human message"
    return exc.value.code()


def gc(plugin):
    return csi_pb2_grpc.GroupControllerStub(plugin.channel)


def create_gs(plugin, name, volume_ids, **params):
    return gc(plugin).CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name=name, source_volume_ids=volume_ids, parameters=params), timeout=120).group_snapshot


def from_snapshot(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    src = csi_pb2.VolumeContentSource()
    src.snapshot.snapshot_id = snapshot_id
    return src


def test_advertised(plugin):
    caps = plugin.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities
    assert PCap.GROUP_CONTROLLER_SERVICE in {c.service.type for c in caps if c.HasField("service")}
    gcaps = gc(plugin).GroupControllerGetCapabilities(csi_pb2.GroupControllerGetCapabilitiesRequest())
    assert [c.rpc.type for c in gcaps.capabilities] == [GCap.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT]


def test_members_are_ordinary_snapshots(plugin):
    vols = [plugin.create(f"m{i}", 32 * MiB) for i in range(2)]
    ids = [v.volume_id for v in vols]
    gs = create_gs(plugin, "gs", ids)
    assert gs.ready_to_use and len(gs.snapshots) == 2
    assert sorted(s.source_volume_id for s in gs.snapshots) == sorted(ids)
    assert all(s.group_snapshot_id == gs.group_snapshot_id and s.ready_to_use for s in gs.snapshots)
    # idempotent repeat (sources in any order)
    assert create_gs(plugin, "gs", ids[::-1]) == gs
    for s in gs.snapshots:
        got = plugin.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=s.snapshot_id)).snapshot
        assert got == s
    listed = plugin.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest()).entries
    assert {e.snapshot.snapshot_id: e.snapshot.group_snapshot_id for e in listed} == \
        {s.snapshot_id: gs.group_snapshot_id for s in gs.snapshots}
    got = gc(plugin).GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=gs.group_snapshot_id, snapshot_ids=[s.snapshot_id for s in gs.snapshots]))
    assert got.group_snapshot == gs
    # restorable from a member's snapshot id
    restored = plugin.create("restored", 32 * MiB, source=from_snapshot(gs.snapshots[0].snapshot_id))
    assert restored.content_source.snapshot.snapshot_id == gs.snapshots[0].snapshot_id


def test_error_table(plugin):
    v1, v2 = (plugin.create(f"e{i}", 32 * MiB).volume_id for i in range(2))
    g = gc(plugin)
    IA = Code.INVALID_ARGUMENT
    assert code_of(lambda: g.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest())) == IA
    assert code_of(lambda: create_gs(plugin, "x", [])) == IA
    assert code_of(lambda: create_gs(plugin, "x", [v1], bogus="1")) == IA
    assert code_of(lambda: create_gs(plugin, "x", [v1, "vol-" + "0" * 24])) == Code.NOT_FOUND
    assert code_of(lambda: create_gs(plugin, "x", ["../etc"])) == IA
    gs = create_gs(plugin, "x", [v1])
    assert code_of(lambda: create_gs(plugin, "x", [v1, v2])) == Code.ALREADY_EXISTS
    member = gs.snapshots[0].snapshot_id

    assert code_of(lambda: g.GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest())) == IA
    missing = csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id="gsnap-" + "0" * 24)
    assert code_of(lambda: g.GetVolumeGroupSnapshot(missing)) == Code.NOT_FOUND
    wrong = csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id=gs.group_snapshot_id,
                                                  snapshot_ids=["snap-" + "1" * 24])
    assert code_of(lambda: g.GetVolumeGroupSnapshot(wrong)) == IA

    # a member cannot be deleted on its own (spec: INVALID_ARGUMENT)
    assert code_of(lambda: plugin.controller.DeleteSnapshot(
        csi_pb2.DeleteSnapshotRequest(snapshot_id=member))) == IA
    assert code_of(lambda: g.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest())) == IA
    assert code_of(lambda: g.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=gs.group_snapshot_id, snapshot_ids=["snap-" + "1" * 24]))) == IA

    # busy objects are ABORTED (the pool's per-object flocks)
    with file_lock(plugin.pool / "locks" / f"{gs.group_snapshot_id}.lock"):
        assert code_of(lambda: g.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(
            group_snapshot_id=gs.group_snapshot_id))) == Code.ABORTED
    with file_lock(plugin.pool / "locks" / f"{name_key('group-snapshot', 'x')}.lock"):
        assert code_of(lambda: create_gs(plugin, "x", [v1])) == Code.ABORTED

    delete = csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=gs.group_snapshot_id,
                                                      snapshot_ids=[member])
    g.DeleteVolumeGroupSnapshot(delete)
    g.DeleteVolumeGroupSnapshot(delete)                       # repeat: OK
    assert code_of(lambda: plugin.controller.GetSnapshot(
        csi_pb2.GetSnapshotRequest(snapshot_id=member))) == Code.NOT_FOUND
    assert not (plugin.pool / "snapshots" / f"{member}.img").exists()
    # the name is free again
    assert create_gs(plugin, "x", [v1, v2]).group_snapshot_id != gs.group_snapshot_id


def test_block_member_in_use_is_refused(plugin, paths):
    """A raw block device has no filesystem to freeze: no consistent instant across several."""
    blk = plugin.create("blk", 32 * MiB, kind="block").volume_id
    fs = plugin.create("fs", 32 * MiB).volume_id
    staging, target = paths("blk")
    plugin.stage(blk, staging, "block")
    plugin.publish(blk, staging, target, "block")
    assert code_of(lambda: create_gs(plugin, "mixed", [blk, fs])) == Code.FAILED_PRECONDITION
    assert create_gs(plugin, "alone", [blk]).ready_to_use      # one member: its own instant
    plugin.unpublish(blk, target)
    plugin.unstage(blk, staging)


SNAPSHOTS = 6


def _fragment(image: Path) -> None:
    """Every other 4 KiB block of the image's upper half written before mkfs (which
    keeps them: nodiscard): thousands of extents, so each reflink takes a while and
    a capture that is not one instant would let the writer move on between members."""
    fd = os.open(image, os.O_WRONLY)
    try:
        for off in range(32 * MiB, 64 * MiB, 8192):
            os.pwrite(fd, b"\xa5" * 4096, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_counter(path: Path, n: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, f"{n:020d}\n".encode(), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_group_snapshot_keeps_a_cross_volume_invariant(plugin, paths):
    """A writer puts counter N on volume 1, then 2, then 3 (each fsynced). Every group
    snapshot must restore to v1 >= v2 >= v3 >= v1 - 1: one instant across all three."""
    vols, targets = [], []
    for i in range(3):
        vid = plugin.create(f"inv{i}", 64 * MiB).volume_id
        _fragment(plugin.pool / "images" / f"{vid}.img")
        staging, target = paths(f"inv{i}")
        plugin.stage(vid, staging)
        plugin.publish(vid, staging, target)
        vols.append(vid)
        targets.append(target)
    stop = threading.Event()
    written = [0]

    def writer():
        n = 0
        while not stop.is_set():
            n += 1
            for t in targets:
                _write_counter(t / "counter", n)
            written[0] = n

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    try:
        groups = []
        for k in range(SNAPSHOTS):
            wait_until(lambda k=k: written[0] >= 5 * (k + 1), 60, "the writer's next rounds", interval=0.01)
            # sources last-written first: without one instant, v1 would be cut after
            # the writer moved on and v3 >= v1 - 1 would break
            groups.append(create_gs(plugin, f"inv-gs{k}", vols[::-1]))
    finally:
        stop.set()
        th.join(timeout=60)
    seen = []
    for k, gs in enumerate(groups):
        by_source = {s.source_volume_id: s.snapshot_id for s in gs.snapshots}
        values = []
        for i, vid in enumerate(vols):
            restored = plugin.create(f"inv-r{k}-{i}", 64 * MiB, source=from_snapshot(by_source[vid])).volume_id
            staging, target = paths(f"r{k}-{i}")
            plugin.stage(restored, staging)
            plugin.publish(restored, staging, target, readonly=True)
            raw = (target / "counter").read_bytes() if (target / "counter").exists() else b"0"
            values.append(int(raw.strip() or b"0"))
            plugin.unpublish(restored, target)
            plugin.unstage(restored, staging)
        v1, v2, v3 = values
        assert v1 >= v2 >= v3 >= v1 - 1, f"group snapshot {k} restored to {values}"
        assert v1 > 0
        seen.append(values)
    assert len({tuple(v) for v in seen}) == SNAPSHOTS, "the writer advanced between snapshots"
    assert "frozen for" in plugin.log_tail(200_000), "the freeze window is logged"
    for vid, t in zip(vols, targets, strict=True):
        plugin.unpublish(vid, t)
