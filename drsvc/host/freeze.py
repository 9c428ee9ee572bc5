"""FIFREEZE/FITHAW of mounted filesystems, for crash-consistent snapshots."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os

log = logging.getLogger(__name__)
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878


def write_back(mountpoints) -> None:
    """syncfs(2) of every mountpoint: their dirty data reaches the images now, unfrozen,
    so a freeze that follows has little to flush and the pre-copy sees most of it.
    Best effort: a failure only leaves more for the freeze to do."""
    libc = ctypes.CDLL(None, use_errno=True)
    for mp in mountpoints:
        try:
            fd = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            log.warning("write-back of %s skipped: %s", mp, e)
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
            fd = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)
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
