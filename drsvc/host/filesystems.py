"""Filesystem probing, creation and online growth."""
from __future__ import annotations

from .. import runner

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
    if fstype == "xfs":
        runner.run(["xfs_growfs", mountpoint], timeout=600)
    else:
        runner.run(["resize2fs", device], timeout=600)
