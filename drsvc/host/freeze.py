"""FIFREEZE/FITHAW of mounted filesystems, for crash-consistent snapshots."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

log = logging.getLogger(__name__)
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878

MountsHeld = Callable[[], AbstractContextManager[list[str]]]
"""Holds some volumes' staged filesystems mounted for a with-block and yields their
mountpoints (``NodeService.mounts_held``): what a capture writes back and freezes."""


def no_mounts() -> AbstractContextManager[list[str]]:
    """No filesystem mounted here: a capture reads the images as they are."""
    return contextlib.nullcontext([])


def _open_mount_root(mp: str) -> int | None:
    """A descriptor of the filesystem mounted at *mp*, or None (logged) when nothing is
    mounted there any more: the directory's own filesystem, its parent's, is never the
    one to write back or freeze."""
    fd = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)
    if os.fstat(fd).st_dev == os.stat(os.path.dirname(os.path.normpath(mp))).st_dev:
        os.close(fd)
        log.warning("%s is no longer a mountpoint: not written back or frozen", mp)
        return None
    return fd


def write_back(mountpoints) -> None:
    """syncfs(2) of every mountpoint: their dirty data reaches the images now, unfrozen,
    so a freeze that follows has little to flush and the pre-copy sees most of it.
    Best effort: a failure only leaves more for the freeze to do."""
    libc = ctypes.CDLL(None, use_errno=True)
    for mp in mountpoints:
        try:
            fd = _open_mount_root(mp)
        except OSError as e:
            log.warning("write-back of %s skipped: %s", mp, e)
            continue
        if fd is None:
            continue
        try:
            if libc.syncfs(fd) != 0:
                log.warning("syncfs of %s failed: %s", mp, os.strerror(ctypes.get_errno()))
        finally:
            os.close(fd)


@contextlib.contextmanager
def frozen(mountpoints):
    """Freeze every mountpoint, yield, then thaw them all, even on error."""
    held = []
    try:
        for mp in mountpoints:
            fd = _open_mount_root(mp)
            if fd is None:
                continue
            try:
                fcntl.ioctl(fd, FIFREEZE, 0)
            except BaseException:
                os.close(fd)
                raise
            held.append((mp, fd))
        yield
    finally:
        for mp, fd in reversed(held):
            try:
                fcntl.ioctl(fd, FITHAW, 0)
            except OSError as e:
                log.error("thaw of %s failed: %s", mp, e)
            finally:
                os.close(fd)
