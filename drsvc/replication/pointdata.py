"""The bytes of recovery points: range sets, undo files, and images built from them.

A point that is not the live replica keeps, per member, an *undo* file: a sparse file
holding, at a set of ranges (its *covered* set), the member's content at the point's
generation wherever a newer generation changed it. Everything outside the covered set
reads as the next newer point (drsvc.replication.points). So a point costs only the
bytes the later generations overwrote, written once, by the receiver, before it applies
them; the live replica keeps being written in place and stays unfragmented.

Ranges are copied in one of two ways (as the receiver's journal does): large aligned
ranges are shared with FICLONERANGE (metadata only), small ones are copied (from the
page cache: a reflink is a transaction of tens of microseconds). A range that reads as
zeros becomes a hole. Every write sets a range to a fixed content, so a run cut short
and run again ends the same.

Range sets are int64 (start, end) arrays, sorted and disjoint (extentplan's algebra);
they travel in point metadata as base64 of little-endian pairs.
"""
from __future__ import annotations

import base64
import errno
import fcntl
import os
import struct
from pathlib import Path

from .blockmap import punch_hole
from .protocol import CODEC_RAW, RECORD

CLONE_MIN = 64 << 10
ALIGN = 4096
FICLONERANGE = 0x4020940D
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.ENOSYS, errno.EINVAL}
_FLAG_INLINE = 0x1 | 0x2          # journal FLAG_DIRECT | FLAG_DATA: the payload is not inline
_CHUNK = 1 << 20


# -- range sets -------------------------------------------------------------------
def empty():
    import numpy as np
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


def norm(starts, ends):
    from .extentplan import normalize
    return normalize(starts, ends)


def union(a, b):
    from .extentplan import normalize
    import numpy as np
    return normalize(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))


def minus(a, b):
    from .extentplan import subtract
    return subtract(a, b)


def total(r) -> int:
    return int((r[1] - r[0]).sum()) if len(r[0]) else 0


def encode(r) -> str:
    import numpy as np
    pairs = np.empty(len(r[0]) * 2, dtype="<i8")
    pairs[0::2], pairs[1::2] = r[0], r[1]
    return base64.b64encode(pairs.tobytes()).decode()


def decode(text: str | None):
    import numpy as np
    if not text:
        return empty()
    pairs = np.frombuffer(base64.b64decode(text), dtype="<i8").astype(np.int64)
    return pairs[0::2].copy(), pairs[1::2].copy()


# -- what one transaction changes -----------------------------------------------------
def changed_ranges(records_path: Path, tx: dict) -> dict:
    """volume id -> the ranges a committed journal changes in that member's image
    (its records, and the growth past the base size). Fresh members are left out:
    they had no image at the base."""
    import numpy as np
    members = tx["members"]
    starts: dict[int, list] = {i: [] for i, m in enumerate(members) if not m["fresh"]}
    ends: dict[int, list] = {i: [] for i in starts}
    with open(records_path, "rb", buffering=_CHUNK) as f:
        while True:
            raw = f.read(RECORD.size)
            if len(raw) < RECORD.size:
                break
            member, codec, flags, offset, length, _ck = RECORD.unpack(raw)
            if codec == CODEC_RAW and not flags & _FLAG_INLINE:
                f.seek(length, os.SEEK_CUR)          # an old journal's inline payload
            if member in starts:
                starts[member].append(offset)
                ends[member].append(offset + length)
    out = {}
    for i, s in starts.items():
        m = members[i]
        if m["size"] > m["base_size"]:
            s.append(m["base_size"])
            ends[i].append(m["size"])
        out[m["volume_id"]] = norm(np.asarray(s, dtype=np.int64), np.asarray(ends[i], dtype=np.int64))
    return out


# -- copying ranges -------------------------------------------------------------------
def _clone(src: int, dst: int, start: int, length: int) -> bool:
    try:
        fcntl.ioctl(dst, FICLONERANGE, struct.pack("=qQQQ", src, start, length, start))
        return True
    except OSError as e:
        if e.errno not in _NO_CLONE:
            raise
        return False


def _data_bytes(fd: int, start: int, end: int) -> int:
    """Bytes of [start, end) of *fd* that are not holes."""
    n, pos = 0, start
    while pos < end:
        try:
            s = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break
            raise
        if s >= end:
            break
        e_ = min(os.lseek(fd, s, os.SEEK_HOLE), end)
        n += e_ - s
        pos = e_
    return n


def _copy(src: int, dst: int, start: int, end: int) -> int:
    n = 0
    pos = start
    while pos < end:
        want = min(_CHUNK, end - pos)
        data = os.pread(src, want, pos)
        if len(data) < want:                  # past the source's end: zeros
            data += bytes(want - len(data))
        if data.count(0) == len(data):
            punch_hole(dst, pos, want)
        else:
            os.pwrite(dst, data, pos)
            n += want
        pos += want
    return n


def copy_ranges(src: int, dst: int, ranges, *, src_size: int | None = None) -> int:
    """Make *dst* equal *src* on every range (zeros where *src* has a hole or ends).
    Returns the data bytes written. The caller fsyncs *dst*."""
    if src_size is None:
        src_size = os.fstat(src).st_size
    starts, ends = ranges
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if s < src_size:
            os.posix_fadvise(src, s, min(e, src_size) - s, os.POSIX_FADV_WILLNEED)
    written = 0
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        inside = min(e, src_size)
        if (inside - s >= CLONE_MIN and not (s | inside) % ALIGN
                and _clone(src, dst, s, inside - s)):
            written += _data_bytes(src, s, inside)
        elif inside > s:
            written += _copy(src, dst, s, inside)
        if e > max(s, inside):
            punch_hole(dst, max(s, inside), e - max(s, inside))
    return written


def fill(src: Path, dst: Path, want, *, size: int) -> int:
    """Copy *want* ranges of file *src* into file *dst* (created sparse, at least *size*
    bytes), durably. Returns the data bytes written."""
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(dfd).st_size < size:
                os.ftruncate(dfd, size)
            n = copy_ranges(sfd, dfd, want)
            os.fsync(dfd)
            return n
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def allocated(path: Path) -> int:
    """Bytes the file holds on disk (its allocated blocks)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
