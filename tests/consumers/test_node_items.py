"""Through a real plugin: a restore or clone larger than its
source shows the requested size at publish (ext4 and xfs), and NodeGetVolumeStats
answers on a block volume's staging path (seed 002, NodeGetVolumeStats: "any path
where the volume was staged or published")."""
from __future__ import annotations

import os

import pytest

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import MiB

SOURCE = 320 * MiB          # mkfs.xfs wants 300 MiB at least
BIGGER = 512 * MiB


def _fs_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def _src(kind, ident):
    s = csi_pb2.VolumeContentSource()
    if kind == "snapshot":
        s.snapshot.snapshot_id = ident
    else:
        s.volume.volume_id = ident
    return s


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
@pytest.mark.parametrize("how", ["snapshot", "volume"])
def test_larger_restore_and_clone_present_requested_size(plugin, paths, fs, how):
    src = plugin.create(f"src-{fs}-{how}", SOURCE, fs)
    staging, target = paths("src")
    plugin.stage(src.volume_id, staging, fs)
    plugin.publish(src.volume_id, staging, target, fs)
    (target / "keep").write_bytes(b"k" * 4096)
    small = _fs_bytes(target)
    plugin.unpublish(src.volume_id, target)
    plugin.unstage(src.volume_id, staging)
    ident = plugin.snapshot(f"snap-{fs}-{how}", src.volume_id).snapshot_id if how == "snapshot" \
        else src.volume_id
    big = plugin.create(f"big-{fs}-{how}", BIGGER, fs, source=_src(how, ident))
    assert big.capacity_bytes >= BIGGER
    staging2, target2 = paths("big")
    plugin.stage(big.volume_id, staging2, fs)
    plugin.publish(big.volume_id, staging2, target2, fs)
    grown = _fs_bytes(target2)
    assert grown > small + (BIGGER - SOURCE) * 3 // 4, (small, grown)
    assert (target2 / "keep").read_bytes() == b"k" * 4096
    plugin.unpublish(big.volume_id, target2)
    plugin.unstage(big.volume_id, staging2)
    # staging again is repeat-safe (xfs_growfs on a full-size filesystem is a no-op)
    plugin.stage(big.volume_id, staging2, fs)
    plugin.unstage(big.volume_id, staging2)


def test_block_stats_on_staging_path(plugin, paths):
    vol = plugin.create("blk-stats", 64 * MiB, "block")
    staging, target = paths("blk")
    staging.mkdir(parents=True, exist_ok=True)        # kubelet makes the staging directory
    plugin.stage(vol.volume_id, staging, "block")
    req = csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=str(staging))
    got = plugin.node.NodeGetVolumeStats(req, timeout=60)
    assert got.usage[0].total == 64 * MiB and got.usage[0].unit == csi_pb2.VolumeUsage.BYTES
    plugin.publish(vol.volume_id, staging, target, "block")
    got = plugin.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=str(target)), timeout=60)
    assert got.usage[0].total == 64 * MiB
    plugin.unpublish(vol.volume_id, target)
    plugin.unstage(vol.volume_id, staging)
