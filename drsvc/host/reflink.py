"""Reflink clones (FICLONE, FICLONERANGE) with a sparse-aware copy fallback, and
early writeback of a file's dirty pages (sync_file_range)."""
from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

from ..logs import logger

log = logger(__name__)
FICLONE = 0x40049409
FICLONERANGE = 0x4020940D
_CLONE_RANGE = struct.Struct("=qQQQ")   # struct file_clone_range: src_fd s64, src_offset, src_length, dest_offset
# the filesystem (or this pair of files) cannot share blocks at all
UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.ENOSYS})
_NO_REFLINK = UNSUPPORTED | {errno.EINVAL}      # EINVAL: this range cannot (unaligned)
SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = None


def data_ranges(fd: int, size: int, *, start: int = 0):
    """Yield (offset, length) of the data regions of *fd* in [start, size), skipping holes."""
    pos = start
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        end = min(end, size)
        if end > start:
            yield start, end - start
        pos = end


def sparse_copy(src_fd: int, dst_fd: int, size: int) -> None:
    os.ftruncate(dst_fd, size)
    for off, length in data_ranges(src_fd, size):
        done = 0
        while done < length:
            n = os.copy_file_range(src_fd, dst_fd, length - done, off + done, off + done)
            if n == 0:
                break
            done += n


def clone_file(src: Path, dst: Path, *, fsync: bool = True) -> bool:
    """Copy *src* to a new file *dst*. Returns True when a reflink was used.

    *dst* must not exist. On filesystems without reflink the fallback is a
    sparse-aware copy, and the fallback is logged.
    """
    with open(src, "rb") as s:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                fcntl.ioctl(fd, FICLONE, s.fileno())
                reflinked = True
            except OSError as e:
                if e.errno not in _NO_REFLINK:
                    raise
                log.warning("reflink unsupported for %s (%s); falling back to a sparse copy",
                            dst.parent, os.strerror(e.errno))
                sparse_copy(s.fileno(), fd, os.fstat(s.fileno()).st_size)
                reflinked = False
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(dst)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)
    return reflinked


def clone_file_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> None:
    """Share [src_offset, +length) of *src_fd* at *dst_offset* of *dst_fd* (FICLONERANGE).
    Raises OSError where the kernel refuses: errno in UNSUPPORTED (no reflink here) or
    EINVAL (this range: not block aligned)."""
    fcntl.ioctl(dst_fd, FICLONERANGE, _CLONE_RANGE.pack(src_fd, src_offset, length, dst_offset))


def clone_range(src_fd: int, dst_fd: int, offset: int, length: int) -> bool:
    """Share [offset, offset+length) of *src_fd* into the same range of *dst_fd*
    (FICLONERANGE). Ranges are block aligned, or end at both files' EOF. Where the
    kernel refuses (unaligned, no reflink) the bytes are copied. True when shared."""
    if length <= 0:
        return True
    try:
        clone_file_range(src_fd, offset, dst_fd, offset, length)
        return True
    except OSError as e:
        if e.errno not in _NO_REFLINK:
            raise
    done = 0
    while done < length:
        n = os.copy_file_range(src_fd, dst_fd, length - done, offset + done, offset + done)
        if n == 0:
            break
        done += n
    return False


def supports_reflink(directory: Path) -> bool:
    probe_src = Path(directory) / ".reflink-probe-src"
    probe_dst = Path(directory) / ".reflink-probe-dst"
    for p in (probe_src, probe_dst):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    probe_src.write_bytes(b"x" * 4096)
    try:
        with open(probe_src, "rb") as s, open(probe_dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        return True
    except OSError:
        return False
    finally:
        for p in (probe_src, probe_dst):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def start_writeback(fd: int) -> None:
    """Queue the dirty pages of *fd* for writeback without waiting (sync_file_range
    WRITE). Durability still comes from an fsync; this only moves the disk work
    earlier. A no-op where the call is missing."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = _load_sync_file_range()
    if _sync_file_range:
        _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


def _load_sync_file_range():
    import ctypes

    from .libc import libc
    try:
        f = libc().sync_file_range
    except (OSError, AttributeError):
        return False
    f.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return f
