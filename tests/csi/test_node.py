"""Node service behaviour through real gRPC: concurrency, read-only publish, stats."""
from __future__ import annotations

import errno
import fcntl
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import grpc
import pytest

from csi_plugin.gen import csi_pb2
from drsvc.host.freeze import FIFREEZE, FITHAW, frozen
from drsvc.host.mounts import parse_mountinfo
from drsvc.node import NodeService
from drsvc.pool import Pool
from drsvc.store import file_lock
from drsvc.volumes import VolumeService
from tests.fixtures.csi import MiB, loops_backing

Code = grpc.StatusCode


def mountinfo():
    return parse_mountinfo(Path("/proc/self/mountinfo").read_text())


def loop_of(pool: Path, volume_id: str) -> str:
    image = str(pool / "images" / f"{volume_id}.img")
    for entry in Path("/sys/block").glob("loop*"):
        try:
            if (entry / "loop" / "backing_file").read_text().strip() == image:
                return f"/dev/{entry.name}"
        except OSError:
            continue
    raise AssertionError(f"no loop device backs {image}")


def test_concurrent_stage_distinct_loops(plugin, paths):
    vols = [plugin.create(f"conc-{i}", 32 * MiB) for i in range(10)]
    stagings = [paths(f"c{i}")[0] for i in range(10)]
    with ThreadPoolExecutor(max_workers=10) as ex:
        list(ex.map(lambda a: plugin.stage(a[0].volume_id, a[1]), zip(vols, stagings, strict=True)))
    devices = [loop_of(plugin.pool, v.volume_id) for v in vols]
    assert len(set(devices)) == 10, devices
    mounted = {m.target: m.source for m in mountinfo()}
    for s, dev in zip(stagings, devices, strict=True):
        assert mounted.get(str(s)) == dev
    with ThreadPoolExecutor(max_workers=10) as ex:
        list(ex.map(lambda a: plugin.unstage(a[0].volume_id, a[1]), zip(vols, stagings, strict=True)))
    assert not any(str(s) in {m.target for m in mountinfo()} for s in stagings)


@pytest.mark.parametrize("kind", ["ext4", "block"])
def test_readonly_publish_refuses_writes(plugin, paths, kind):
    vol = plugin.create(f"ro-{kind}", 32 * MiB, kind)
    staging, target = paths("ro")
    plugin.stage(vol.volume_id, staging, kind)
    plugin.publish(vol.volume_id, staging, target, kind, readonly=True)
    path = target if kind == "block" else target / "new-file"
    with pytest.raises(OSError) as exc:
        fd = os.open(path, os.O_WRONLY | (0 if kind == "block" else os.O_CREAT), 0o600)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    assert exc.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM), exc.value
    # reading still works, and stats see the read-only device as this volume's
    if kind == "block":
        with open(target, "rb") as f:
            assert len(f.read(4096)) == 4096
    else:
        assert os.listdir(target) is not None
    r = stats(plugin, vol.volume_id, target)
    assert not r.volume_condition.abnormal
    plugin.unpublish(vol.volume_id, target)
    plugin.unstage(vol.volume_id, staging)
    assert loops_backing(plugin.pool / "images") == []


def test_delete_staged_volume_is_refused(plugin, paths):
    vol = plugin.create("busy", 32 * MiB)
    staging, target = paths("busy")
    plugin.stage(vol.volume_id, staging)
    before = sorted(os.listdir(plugin.pool / "images"))
    with pytest.raises(grpc.RpcError) as exc:
        plugin.delete(vol.volume_id)
    assert exc.value.code() == Code.FAILED_PRECONDITION and exc.value.details()
    assert sorted(os.listdir(plugin.pool / "images")) == before
    assert plugin.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(
        volume_id=vol.volume_id)).volume.volume_id == vol.volume_id
    # published too: still refused
    plugin.publish(vol.volume_id, staging, target)
    with pytest.raises(grpc.RpcError) as exc:
        plugin.delete(vol.volume_id)
    assert exc.value.code() == Code.FAILED_PRECONDITION
    plugin.unpublish(vol.volume_id, target)
    plugin.unstage(vol.volume_id, staging)
    plugin.delete(vol.volume_id)
    assert os.listdir(plugin.pool / "images") == []


def test_busy_volume_is_aborted_and_others_proceed(plugin, paths):
    busy = plugin.create("locked", 32 * MiB)
    free = plugin.create("unlocked", 32 * MiB)
    staging, _ = paths("locked")
    other, _ = paths("unlocked")
    # the plugin's per-volume flock, held from this process as an in-flight op would
    with file_lock(plugin.pool / "locks" / f"{busy.volume_id}.lock"):
        for call in (lambda: plugin.stage(busy.volume_id, staging),
                     lambda: plugin.delete(busy.volume_id),
                     lambda: plugin.unstage(busy.volume_id, staging),
                     lambda: plugin.controller.ControllerExpandVolume(
                         csi_pb2.ControllerExpandVolumeRequest(
                             volume_id=busy.volume_id,
                             capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MiB)))):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == Code.ABORTED and exc.value.details()
        plugin.stage(free.volume_id, other)        # a different volume is not held up
        plugin.unstage(free.volume_id, other)
    plugin.stage(busy.volume_id, staging)           # released: the retry succeeds
    plugin.unstage(busy.volume_id, staging)


def stats(plugin, volume_id, path):
    return plugin.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=volume_id, volume_path=str(path)), timeout=30)


def test_volume_stats_mount(plugin, paths):
    vol = plugin.create("stats", 64 * MiB)
    staging, target = paths("st")
    plugin.stage(vol.volume_id, staging)
    plugin.publish(vol.volume_id, staging, target)
    (target / "f").write_bytes(os.urandom(8 * MiB))
    os.sync()
    r = stats(plugin, vol.volume_id, target)
    units = {u.unit: u for u in r.usage}
    b, i = units[csi_pb2.VolumeUsage.BYTES], units[csi_pb2.VolumeUsage.INODES]
    vfs = os.statvfs(target)
    assert b.total == vfs.f_blocks * vfs.f_frsize
    assert b.used >= 8 * MiB and 0 < b.available < b.total
    assert i.total == vfs.f_files and i.used >= 1
    assert not r.volume_condition.abnormal


def test_volume_stats_block(plugin, paths):
    vol = plugin.create("stats-b", 64 * MiB, "block")
    staging, target = paths("stb")
    plugin.stage(vol.volume_id, staging, "block")
    plugin.publish(vol.volume_id, staging, target, "block")
    r = stats(plugin, vol.volume_id, target)
    assert r.usage[0].unit == csi_pb2.VolumeUsage.BYTES and r.usage[0].total == 64 * MiB
    assert not r.volume_condition.abnormal


def test_condition_when_image_deleted(plugin, paths):
    vol = plugin.create("gone", 32 * MiB)
    staging, target = paths("gone")
    plugin.stage(vol.volume_id, staging)
    plugin.publish(vol.volume_id, staging, target)
    os.unlink(plugin.pool / "images" / f"{vol.volume_id}.img")
    r = stats(plugin, vol.volume_id, target)
    assert r.volume_condition.abnormal and r.volume_condition.message
    cond = plugin.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(
        volume_id=vol.volume_id)).status.volume_condition
    assert cond.abnormal and cond.message


def test_condition_when_loop_detached(plugin, paths):
    vol = plugin.create("detached", 32 * MiB, "block")
    staging, target = paths("det")
    plugin.stage(vol.volume_id, staging, "block")
    plugin.publish(vol.volume_id, staging, target, "block")
    dev = loop_of(plugin.pool, vol.volume_id)
    subprocess.run(["umount", str(target)], check=True)
    subprocess.run(["losetup", "-d", dev], check=True)
    target.touch()
    r = stats(plugin, vol.volume_id, target)
    assert r.volume_condition.abnormal and r.volume_condition.message
    # recovery: unpublish/unstage still succeed after the device vanished
    plugin.unpublish(vol.volume_id, target)
    plugin.unstage(vol.volume_id, staging)
    plugin.delete(vol.volume_id)



def test_unstage_waits_for_a_capture_holding_the_filesystem(plugin, paths):
    """A sync's capture at a primary holds the staged filesystem open (syncfs, then
    FIFREEZE) while the CO unstages it: in the demo's failover, b's scheduled sync ran as
    its check unmounted, and NodeUnstageVolume failed with "umount: target is busy". The
    unstage now waits for the capture (the volume's mount lock), then unmounts."""
    vol = plugin.create("held", 32 * MiB)
    staging, _ = paths("held")
    plugin.stage(vol.volume_id, staging)
    pool = Pool.existing(plugin.pool)
    node = NodeService(pool, VolumeService(pool, "test"), "test")
    with ThreadPoolExecutor(max_workers=1) as ex:
        with node.mounts_held([vol.volume_id]) as mountpoints, frozen(mountpoints):
            assert mountpoints == [str(staging)]
            unstage = ex.submit(plugin.unstage, vol.volume_id, staging)
            with pytest.raises(FutureTimeout):     # waiting for the capture, not failed busy
                unstage.result(timeout=2)
        unstage.result(timeout=60)                 # released: the unmount went through
    assert str(staging) not in {m.target for m in mountinfo()}
    assert loops_backing(plugin.pool / "images") == []
    with node.mounts_held([vol.volume_id]) as mountpoints:
        assert mountpoints == []                   # nothing staged: a capture freezes nothing



def test_a_freeze_skips_a_directory_nothing_is_mounted_on(xfs_dir):
    """A capture handed a staging path whose filesystem is gone must not freeze the
    filesystem that directory lives on (a node's own). Probed without writing: the
    filesystem, were it frozen, would refuse a second FIFREEZE with EBUSY."""
    empty = Path(xfs_dir) / "was-staged"
    empty.mkdir()
    with frozen([str(empty)]):
        fd = os.open(xfs_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)            # free to freeze: the code above did not
            fcntl.ioctl(fd, FITHAW, 0)
        finally:
            os.close(fd)
