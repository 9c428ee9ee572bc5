"""Bench-local helpers over drsvc_lab: a loop-mounted XFS, a loopback sshd for a pool,
and cold caches.

bench/ does not import tests/: the lab parts come from drsvc_lab (processes through
drsvc.runner). The sshd binds the replication key to our receiver (forced command) and,
for rsync, adds an unrestricted key; both use ``environment="SHLVL=1"`` so bash skips
root's ~/.bashrc (~0.15 s a start).
"""
from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from drsvc_lab import backing_file, loop_fs, pool_sshd

__all__ = ["Cold", "backing_file", "drop_file_cache", "loop_mounted_xfs", "rsync_ssh", "sshd_site"]


def loop_mounted_xfs(size: str = "40G"):
    """A context manager: the mountpoint of a fresh sparse XFS (reflink on) on a loop device."""
    return loop_fs(size, prefix="drsvc-bench-xfs-")


def sshd_site(pool: Path):
    """A context manager: a loopback sshd for *pool*, replication key (forced receiver) + a plain key."""
    return pool_sshd(pool, plain_key=True)


def rsync_ssh(site) -> str:
    """The ssh command rsync runs (-e) to reach the bench's sshd with its plain key."""
    return (f"ssh -c aes128-gcm@openssh.com -p {site.port} -i {site.plain_key} "
            f"-o UserKnownHostsFile={site.known_hosts} -o StrictHostKeyChecking=yes "
            f"-o BatchMode=yes -o IdentitiesOnly=yes")


def _syncfs(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


@dataclass
class Cold:
    """Makes the next reads of the bench's data cold.

    mode "files" (default, kind to other users of the machine): sync each bench
    filesystem, evict every file in it (POSIX_FADV_DONTNEED) and then its loop
    device's backing file, whose pages in the host's cache would otherwise serve the
    "cold" reads. XFS's own metadata buffers stay cached. mode "global": `sync; echo
    3 > /proc/sys/vm/drop_caches` (everything, everyone's). mode "off": --warm."""
    roots: list
    backings: list
    mode: str = "files"

    def __call__(self) -> None:
        if self.mode == "off":
            return
        if self.mode == "global":
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        for root in self.roots:
            _syncfs(root)
            for d, _, names in os.walk(root):
                drop_file_cache(*(os.path.join(d, n) for n in names), sync=False)
        drop_file_cache(*self.backings)


def drop_file_cache(*paths, sync: bool = True) -> None:
    """Evict the clean page-cache pages of these files (POSIX_FADV_DONTNEED), so a
    tool reads them cold; per file, so other users of the machine keep their cache."""
    for p in paths:
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if sync:
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
