"""Filesystem probing, creation and online growth."""
from __future__ import annotations

from .. import runner
from ..errors import CommandFailed, PreconditionFailed

SUPPORTED = ("ext4", "xfs")
DEFAULT = "ext4"
# mkfs.xfs refuses filesystems smaller than this
MIN_BYTES = {"xfs": 300 * 1024 * 1024, "ext4": 1024 * 1024}


def probe(device: str) -> str | None:
    """The filesystem type on *device*, or None when it holds no signature."""
    r = runner.run(["blkid", "-p", "-o", "value", "-s", "TYPE", device],
                   timeout=60, ok_codes=(0, 2))
    return r.stdout.strip() or None if r.rc == 0 else None


def mkfs(device: str, fstype: str) -> None:
    if fstype == "xfs":
        argv = ["mkfs.xfs", "-q", device]
    else:
        # lazy init keeps mkfs fast on big sparse images
        argv = ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", device]
    runner.run(argv, timeout=600)


def grow(device: str, fstype: str, mountpoint: str) -> None:
    """Grow a mounted filesystem to its device's size."""
    if fstype == "xfs":
        runner.run(["xfs_growfs", mountpoint], timeout=600)
        return
    try:
        runner.run(["resize2fs", device], timeout=600)
    except CommandFailed as e:
        # EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE; without it only an offline grow works
        if "Permission denied to resize" in e.stderr_tail or "Operation not permitted" in e.stderr_tail:
            raise PreconditionFailed(
                "this host may not grow ext4 online (the plugin lacks CAP_SYS_RESOURCE); unpublish and "
                "unstage the volume: the next NodeStageVolume grows it before mounting") from None
        raise


def ext4_bytes(device: str) -> int:
    """The size the ext4 filesystem on *device* spans (from its superblock)."""
    out = runner.run(["dumpe2fs", "-h", device], timeout=60).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return int(fields["Block count"]) * int(fields["Block size"])


def grow_offline(device: str, fstype: str, device_bytes: int) -> bool:
    """Grow an unmounted ext4 to fill its device; True when it grew. (xfs grows only mounted.)"""
    if fstype != "ext4" or ext4_bytes(device) >= device_bytes - (1 << 20):
        return False
    # resize2fs insists on a freshly checked filesystem; -p repairs only what is safe
    runner.run(["e2fsck", "-f", "-p", device], timeout=1800, ok_codes=(0, 1))
    runner.run(["resize2fs", device], timeout=1800)
    return True
