"""Node side: stage (loop + mkfs + mount), publish (bind mounts), stats, expansion.

The node state document records what was done, and every step first checks
the kernel's view (sysfs loop backing files, mountinfo), so re-issuing an RPC
after a plugin restart finishes the job instead of repeating it.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from . import store
from .errors import (CapacityOutOfRange, Conflict, InvalidInput, MissingField, NotFound, PreconditionFailed,
                     VolumeAttached, VolumeNotFound)
from .host import filesystems, freeze, loop, mounts
from .ids import check_id
from .model import BLOCK, MOUNT, READONLY_MODES, Capability, NodeState
from .pool import Pool
from .volumes import VolumeService, check_capabilities

log = logging.getLogger(__name__)
MAX_VOLUMES_PER_NODE = 256
UNMOUNT_WAIT_S = 30.0      # how long an unstage waits for a capture holding the filesystem open


@dataclass(frozen=True)
class VolumeStats:
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int = 0
    available_inodes: int = 0
    used_inodes: int = 0
    block: bool = False
    abnormal: bool = False
    message: str = "volume is healthy"


def _require(value, field: str):
    if not value:
        raise MissingField(field=field)
    return value


def _served_path(value: str, field: str) -> str:
    """A path the CO asks about (stats, expand): a relative one is not one we serve."""
    _require(value, field)
    if not os.path.isabs(value):
        raise NotFound(f"{field} {value[:200]!r} is not a path this plugin published (not absolute)")
    return value


def _require_path(value: str, field: str) -> str:
    """A CO path: required and absolute (a relative one would land in the plugin's cwd)."""
    _require(value, field)
    if not os.path.isabs(value):
        raise InvalidInput(f"{field} must be an absolute path, got {value[:200]!r}")
    return value


class NodeService:
    def __init__(self, pool: Pool, volumes: VolumeService, node_id: str, *, publish_policy=None):
        self.pool = pool
        self.volumes = volumes
        self.node_id = node_id
        # publish_policy(volume_id, readonly) may raise to refuse a publish
        # (the replication layer refuses read-write on a secondary).
        self.publish_policy = publish_policy

    # -- state -----------------------------------------------------------------
    def find_state(self, volume_id: str) -> NodeState | None:
        doc = store.read_doc(self.pool.node_state(volume_id))
        return NodeState.from_doc(doc) if doc else None

    def _save(self, st: NodeState) -> None:
        store.write_doc(self.pool.node_state(st.volume_id), st.to_doc())

    def in_use(self, volume_id: str) -> str:
        """Why *volume_id* may not be deleted, or '' when it may."""
        st = self.find_state(volume_id)
        if st is None:
            return ""
        if st.targets:
            return f"published at {', '.join(sorted(st.targets))}"
        if st.staging_path:
            return f"staged at {st.staging_path}"
        return ""

    def read_write_attachments(self, volume_id: str) -> list[str]:
        """Where the volume's image is attached read-write on this node, from the node
        record and from the kernel (writable loop devices backing it, their mounts)."""
        found = []
        st = self.find_state(volume_id)
        if st is not None:
            found += [f"published read-write at {t}" for t, o in sorted(st.targets.items())
                      if not o.get("readonly")]
            if st.staging_path and (st.device or mounts.is_mounted(st.staging_path)):
                found.append(f"staged at {st.staging_path}")
        for dev in loop.attached_devices(self.pool.image(volume_id), readonly=False):
            where = mounts.mountpoints_of_device(dev) if os.path.exists(dev) else []
            found.append(f"writable {dev}" + (f" mounted at {', '.join(where)}" if where else ""))
        return found

    def ensure_not_attached_read_write(self, volume_id: str) -> None:
        """Raise VolumeAttached while anything on this node can write the image."""
        if found := self.read_write_attachments(volume_id):
            raise VolumeAttached(volume_id=volume_id, reason="; ".join(found)
                                 + ": stop its writers, unpublish and unstage it first")

    @contextlib.contextmanager
    def consistent(self, volume_id: str):
        """Freeze the volume's filesystem if it is mounted here (for snapshots)."""
        with self.mounts_held([volume_id]) as mountpoints, freeze.frozen(mountpoints):
            yield

    @contextlib.contextmanager
    def mounts_held(self, volume_ids):
        """The staging mountpoints of those of *volume_ids* mounted here, kept mounted for
        the with-block: an unstage waits for its end (``Pool.mount_lock``), so a capture never
        opens a staging path that is being unmounted, nor makes the unmount fail busy."""
        with contextlib.ExitStack() as stack:
            for vid in sorted(set(volume_ids)):
                stack.enter_context(self.pool.mount_lock(vid, shared=True))
            yield [mp for vid in volume_ids if (mp := self.mountpoint(vid))]

    def mountpoint(self, volume_id: str) -> str | None:
        st = self.find_state(volume_id)
        if st and st.access_type == MOUNT and st.staging_path and mounts.is_mounted(st.staging_path):
            return st.staging_path
        return None

    # -- stage -------------------------------------------------------------------
    def stage(self, volume_id: str, staging_path: str, cap: Capability | None) -> None:
        check_id(volume_id)
        _require_path(staging_path, "staging_target_path")
        if cap is None:
            raise MissingField(field="volume_capability")
        check_capabilities([cap])
        vol = self.volumes.get_volume(volume_id)
        staging_path = os.path.normpath(staging_path)
        if self.publish_policy is not None:
            self.publish_policy(volume_id, cap.access_mode in READONLY_MODES)
        with self.pool.lock(volume_id):
            st = self.find_state(volume_id) or NodeState(volume_id=volume_id)
            if st.staging_path and st.staging_path != staging_path:
                raise Conflict(f"volume {volume_id} is already staged at {st.staging_path}")
            if st.access_type and st.access_type != cap.access_type:
                raise Conflict(f"volume {volume_id} is staged for {st.access_type} access, not {cap.access_type}")
            image = self.pool.image(volume_id)
            device = loop.attach(image)
            st.staging_path, st.access_type, st.device = staging_path, cap.access_type, device
            self._save(st)                      # intent: a restart knows the device
            if cap.access_type == MOUNT:
                st.fs_type = self._ensure_filesystem(device, cap.fs_type or vol.fs_type or filesystems.DEFAULT)
                self._save(st)
                if not mounts.is_mounted(staging_path):
                    if cap.access_mode not in READONLY_MODES and \
                            filesystems.grow_offline(device, st.fs_type, loop.size_bytes(device)):
                        log.info("volume %s: ext4 grown offline to %d bytes", volume_id, loop.size_bytes(device))
                    os.makedirs(staging_path, exist_ok=True)
                    opts = list(cap.mount_flags)
                    if cap.access_mode in READONLY_MODES:
                        opts.append("ro")
                    mounts.mount(device, staging_path, fstype=st.fs_type, options=opts)
                    if cap.access_mode not in READONLY_MODES and st.fs_type == "xfs":
                        # xfs grows only mounted: a restore or clone larger than its source
                        # presents the requested size from the first publish (a no-op otherwise)
                        filesystems.grow(device, "xfs", staging_path)
            log.info("volume %s staged at %s on %s", volume_id, staging_path, device)

    def _ensure_filesystem(self, device: str, wanted: str) -> str:
        found = filesystems.probe(device)
        if found is None:
            filesystems.mkfs(device, wanted)
            return wanted
        if found != wanted:
            # never reformat data
            raise PreconditionFailed(f"device holds a {found} filesystem; {wanted} was requested")
        return found

    def unstage(self, volume_id: str, staging_path: str) -> None:
        check_id(volume_id)
        _require_path(staging_path, "staging_target_path")
        if self.volumes.find_volume(volume_id) is None and self.find_state(volume_id) is None:
            raise VolumeNotFound(volume_id=volume_id)
        staging_path = os.path.normpath(staging_path)
        with self.pool.lock(volume_id):
            st = self.find_state(volume_id)
            if st is None:
                return
            live = [t for t in st.targets if mounts.is_mounted(t)]
            if live:
                raise PreconditionFailed(f"volume {volume_id} is still published at {', '.join(live)}")
            with self.pool.mount_lock(volume_id, wait=UNMOUNT_WAIT_S):
                mounts.ensure_unmounted(staging_path)
            loop.detach_image(self.pool.image(volume_id))
            store.remove(self.pool.node_state(volume_id))
            log.info("volume %s unstaged from %s", volume_id, staging_path)

    # -- publish -----------------------------------------------------------------
    def publish(self, volume_id: str, target_path: str, staging_path: str,
                cap: Capability | None, readonly: bool) -> None:
        check_id(volume_id)
        _require_path(target_path, "target_path")
        _require_path(staging_path, "staging_target_path")
        if cap is None:
            raise MissingField(field="volume_capability")
        check_capabilities([cap])
        self.volumes.get_volume(volume_id)
        target_path = os.path.normpath(target_path)
        staging_path = os.path.normpath(staging_path)
        readonly = readonly or cap.access_mode in READONLY_MODES
        if self.publish_policy is not None:
            self.publish_policy(volume_id, readonly)
        with self.pool.lock(volume_id):
            st = self.find_state(volume_id)
            if st is None or st.staging_path != staging_path:
                raise PreconditionFailed(f"volume {volume_id} is not staged at {staging_path}")
            if st.access_type != cap.access_type:
                raise Conflict(f"volume {volume_id} is staged for {st.access_type} access, not {cap.access_type}")
            prev = st.targets.get(target_path)
            if prev is not None and prev["readonly"] != readonly and mounts.is_mounted(target_path):
                raise Conflict(f"volume {volume_id} is already published at {target_path} "
                               f"{'read-only' if prev['readonly'] else 'read-write'}")
            others = [t for t in st.targets if t != target_path and mounts.is_mounted(t)]
            if others and (cap.access_mode == "SINGLE_NODE_SINGLE_WRITER"
                           or any(st.targets[t].get("single_writer") for t in others)):
                raise PreconditionFailed(f"volume {volume_id} is single-writer and already published at "
                                         f"{others[0]}")
            st.targets[target_path] = {"readonly": readonly,
                                       "single_writer": cap.access_mode == "SINGLE_NODE_SINGLE_WRITER"}
            self._save(st)
            if mounts.is_mounted(target_path):
                return
            if cap.access_type == BLOCK:
                Path(target_path).parent.mkdir(parents=True, exist_ok=True)
                if not os.path.exists(target_path):
                    os.close(os.open(target_path, os.O_CREAT | os.O_WRONLY, 0o660))
                # a read-only mount does not stop writes through a device node it
                # holds; only a read-only device does (unstage detaches it too)
                device = loop.attach(self.pool.image(volume_id), readonly=True) if readonly else st.device
                mounts.bind_mount(device, target_path, readonly=readonly)
            else:
                os.makedirs(target_path, exist_ok=True)
                mounts.bind_mount(staging_path, target_path, readonly=readonly)
            log.info("volume %s published at %s%s", volume_id, target_path, " (ro)" if readonly else "")

    def unpublish(self, volume_id: str, target_path: str) -> None:
        check_id(volume_id)
        _require_path(target_path, "target_path")
        if self.volumes.find_volume(volume_id) is None and self.find_state(volume_id) is None:
            raise VolumeNotFound(volume_id=volume_id)
        target_path = os.path.normpath(target_path)
        with self.pool.lock(volume_id):
            mounts.ensure_unmounted(target_path)
            self._remove_target(target_path)
            st = self.find_state(volume_id)
            if st is not None and target_path in st.targets:
                del st.targets[target_path]
                self._save(st)

    @staticmethod
    def _remove_target(path: str) -> None:
        # we created it in publish; the spec asks us to remove it
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass

    # -- stats and expansion -------------------------------------------------------
    def _serves(self, st: NodeState, path: str) -> bool:
        if not st.device or not os.path.exists(st.device):
            return False
        rdev = os.stat(st.device).st_rdev
        devno = f"{os.major(rdev)}:{os.minor(rdev)}"
        if st.access_type == BLOCK:
            if path == st.staging_path:
                return True         # staged: the device that backs the image (checked by the caller)
            if not any(m.target == path for m in mounts.mounts()):
                return False
            there = os.stat(path).st_rdev
            if there == rdev:
                return True
            # a read-only publish binds its own read-only loop of the same image
            try:
                name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(there)}:{os.minor(there)}"))
            except OSError:
                return False
            return loop.backing_of(name) == str(self.pool.image(st.volume_id))
        return any(m.devno == devno for m in mounts.mounts_at(path))

    def stats(self, volume_id: str, volume_path: str) -> VolumeStats:
        check_id(volume_id)
        _served_path(volume_path, "volume_path")
        self.volumes.get_volume(volume_id)
        volume_path = os.path.normpath(volume_path)
        if not os.path.exists(volume_path):
            raise NotFound(f"volume path {volume_path} does not exist")
        st = self.find_state(volume_id)
        if st is None:
            raise NotFound(f"volume {volume_id} is not staged on this node")
        image = self.pool.image(volume_id)
        problem = ""
        if not image.exists():
            problem = f"backing image {image.name} is missing"
        elif not st.device or loop.backing_of(st.device) != str(image):
            problem = f"loop device {st.device or '?'} no longer backs the volume"
        if not problem and not self._serves(st, volume_path):
            raise NotFound(f"volume {volume_id} is not mounted at {volume_path}")
        if st.access_type == BLOCK:
            size = loop.size_bytes(st.device) if not problem else 0
            return VolumeStats(size, 0, 0, block=True, abnormal=bool(problem), message=problem or "volume is healthy")
        if problem:
            return VolumeStats(0, 0, 0, abnormal=True, message=problem)
        vfs = os.statvfs(volume_path)
        total, avail = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        used = total - vfs.f_bfree * vfs.f_frsize
        return VolumeStats(total, avail, used, vfs.f_files, vfs.f_favail, vfs.f_files - vfs.f_ffree)

    def expand(self, volume_id: str, volume_path: str, required_bytes: int = 0, limit_bytes: int = 0) -> int:
        check_id(volume_id)
        _served_path(volume_path, "volume_path")
        vol = self.volumes.get_volume(volume_id)
        if required_bytes > vol.capacity_bytes:
            raise CapacityOutOfRange(reason=f"required_bytes {required_bytes} is above the volume's "
                                            f"{vol.capacity_bytes} bytes; call ControllerExpandVolume first")
        volume_path = os.path.normpath(volume_path)
        if not os.path.exists(volume_path):
            raise NotFound(f"volume path {volume_path} does not exist")
        with self.pool.lock(volume_id):
            st = self.find_state(volume_id)
            if st is None or not st.device:
                raise NotFound(f"volume {volume_id} is not staged on this node")
            if loop.size_bytes(st.device) < vol.capacity_bytes:
                loop.refresh_capacity(st.device)
            if st.access_type == MOUNT:
                mp = st.staging_path if mounts.is_mounted(st.staging_path) else volume_path
                filesystems.grow(st.device, st.fs_type, mp)
            return loop.size_bytes(st.device)
