"""Controller and cross-cutting behaviour: idempotency, paging, capacity, secrets, socket."""
from __future__ import annotations

import os
import stat
import uuid

import grpc
import pytest

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import MiB, capability, has_cap_sys_resource

Code = grpc.StatusCode


def code_of(call):
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.details(), "every error carries a human message"
    return exc.value.code()


def test_every_mutating_rpc_is_idempotent(plugin, paths):
    c, n = plugin.controller, plugin.node
    a = plugin.create("idem", 64 * MiB)
    assert plugin.create("idem", 64 * MiB) == a
    snap = plugin.snapshot("idem-snap", a.volume_id)
    assert plugin.snapshot("idem-snap", a.volume_id) == snap

    expand = csi_pb2.ControllerExpandVolumeRequest(
        volume_id=a.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=128 * MiB))
    assert c.ControllerExpandVolume(expand) == c.ControllerExpandVolume(expand)

    staging, target = paths("idem")
    assert plugin.stage(a.volume_id, staging) == plugin.stage(a.volume_id, staging)
    assert plugin.publish(a.volume_id, staging, target) == plugin.publish(a.volume_id, staging, target)
    node_expand = csi_pb2.NodeExpandVolumeRequest(volume_id=a.volume_id, volume_path=str(target))
    if has_cap_sys_resource():      # online ext4 growth
        assert n.NodeExpandVolume(node_expand) == n.NodeExpandVolume(node_expand)
    assert plugin.unpublish(a.volume_id, target) == plugin.unpublish(a.volume_id, target)
    assert plugin.unstage(a.volume_id, staging) == plugin.unstage(a.volume_id, staging)

    del_snap = csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id)
    assert c.DeleteSnapshot(del_snap) == c.DeleteSnapshot(del_snap)
    assert plugin.delete(a.volume_id) == plugin.delete(a.volume_id)
    assert os.listdir(plugin.pool / "images") == [] and os.listdir(plugin.pool / "snapshots") == []


def test_same_name_different_properties(plugin):
    a = plugin.create("dup", 64 * MiB)
    assert code_of(lambda: plugin.create("dup", 128 * MiB)) == Code.ALREADY_EXISTS
    assert code_of(lambda: plugin.create("dup", 16 * MiB, limit=32 * MiB)) == Code.ALREADY_EXISTS
    assert code_of(lambda: plugin.create("dup", 64 * MiB, preallocate="true")) == Code.ALREADY_EXISTS
    b = plugin.create("other", 64 * MiB)
    plugin.snapshot("dup-snap", a.volume_id)
    assert code_of(lambda: plugin.snapshot("dup-snap", b.volume_id)) == Code.ALREADY_EXISTS
    # the failed attempts created nothing
    assert len(os.listdir(plugin.pool / "images")) == 2


def list_all(fetch, page):
    """Follow next_token to the end; returns the pages' sizes and the ids."""
    sizes, ids, token = [], [], ""
    while True:
        resp = fetch(page, token)
        sizes.append(len(resp.entries))
        ids += [e.volume.volume_id if hasattr(e, "volume") and e.HasField("volume")
                else e.snapshot.snapshot_id for e in resp.entries]
        token = resp.next_token
        if not token:
            return sizes, ids


def test_list_paging(plugin):
    vols = [plugin.create(f"page-{i}", 16 * MiB).volume_id for i in range(7)]
    snaps = [plugin.snapshot(f"page-snap-{i}", vols[0]).snapshot_id for i in range(7)]

    def volumes(n, token):
        return plugin.controller.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=n, starting_token=token))

    def snapshots(n, token):
        return plugin.controller.ListSnapshots(
            csi_pb2.ListSnapshotsRequest(max_entries=n, starting_token=token))

    for fetch, want in ((volumes, vols), (snapshots, snaps)):
        sizes, ids = list_all(fetch, 3)
        assert sizes == [3, 3, 1] and sorted(ids) == sorted(want) and len(set(ids)) == 7
        assert sorted(list_all(fetch, 0)[1]) == sorted(want)
        for bad in ("nonsense", "99", "-1", "3x"):
            assert code_of(lambda fetch=fetch, bad=bad: fetch(3, bad)) == Code.ABORTED

    one = plugin.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=snaps[2]))
    assert [e.snapshot.snapshot_id for e in one.entries] == [snaps[2]]
    none = plugin.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id="snap-missing"))
    assert list(none.entries) == []
    by_src = plugin.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(source_volume_id=vols[1]))
    assert list(by_src.entries) == []


def test_get_capacity_tracks_pool(plugin):
    def available():
        return plugin.controller.GetCapacity(csi_pb2.GetCapacityRequest(
            volume_capabilities=[capability("ext4")])).available_capacity

    st = os.statvfs(plugin.pool)
    free = st.f_bavail * st.f_frsize
    got = available()
    assert abs(got - free) < 64 * MiB, (got, free)
    # a preallocated volume really consumes pool space
    plugin.create("eats-space", 512 * MiB, preallocate="true")
    assert got - available() >= 448 * MiB


def test_secrets_never_reach_the_log(make_plugin, paths):
    plugin = make_plugin("--log-level", "DEBUG")
    secret = f"s3cr3t-{uuid.uuid4()}"
    secrets = {"password": secret}
    vol = plugin.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="secretive", capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MiB),
        volume_capabilities=[capability("ext4")], secrets=secrets)).volume
    staging, target = paths("sec")
    plugin.stage(vol.volume_id, staging, secrets=secrets)
    plugin.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging), target_path=str(target),
        volume_capability=capability("ext4"), secrets=secrets))
    plugin.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        name="secretive-snap", source_volume_id=vol.volume_id, secrets=secrets))
    # a failing call logs too: the secret must not ride along in an error path
    with pytest.raises(grpc.RpcError):
        plugin.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id, secrets=secrets))
    plugin.unpublish(vol.volume_id, target)
    plugin.unstage(vol.volume_id, staging)
    plugin.stop()
    text = plugin.log_path.read_text(errors="replace")
    assert "NodeStageVolume <-" in text, "DEBUG request logging must be on for this test to mean anything"
    assert secret not in text
    assert "s3cr3t" not in text


def test_socket_is_private(plugin):
    mode = stat.S_IMODE(os.stat(plugin.sock).st_mode)
    assert mode & 0o002 == 0, oct(mode)
    assert mode & 0o077 == 0, f"socket should be 0600, is {oct(mode)}"
