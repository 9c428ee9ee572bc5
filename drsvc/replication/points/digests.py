"""The recorded digests of recovery points' bytes, and checking a point against them.

A point's bytes are kept as undo logs and whole images (``index``), and a verify
(``control.scrub``) checks them the way it checks the replica: it reads them back and
compares with digests recorded when they were written (``block_digest``'s xxh3-128, as the
block maps use).

* An undo log's digests are its *sums* file, beside it (``<vol>.undo.sums``): a 16-byte
  header (magic, the first log block covered) and one digest per 4 KiB block of the log, in
  log order. The log is packed at 4 KiB positions (``undo_log``), so every block has a fixed
  content (data, then zeros to the boundary) and the digest of each is taken from the bytes
  as they are appended (a copied range is in hand; a range shared by reflink is read once
  from its source, or takes the source log's recorded digests). Like the log, the sums file
  only grows and is cut back to what the point's map names before the next append, and it is
  made durable before the map that names the bytes: a kill leaves digests past the map's
  end, never a named block without its digest. A log begun by a release that kept no digests
  starts its sums where the new appends begin: the older blocks are unverifiable.
* A whole image's digests are a block map beside it (``<vol>.img.map``): a seal copies the
  receiver's recorded map of the replica (``common.replica_maps``) when it describes the
  generation sealed, so nothing is read; an image built from other points (a fold) takes
  its sources' recorded digests (``record_built_image``). No recorded map: the image is
  unverifiable.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ...layout import PoolLayout
from ..common.blockmap import DIGEST, ZERO, BlockMap, block_count, digest_blocks, hash_range
from ..common.replica_maps import ReplicaMaps
from ..common.unit_state import find_state

SUMS_MAGIC = b"DRUNDSUM"
SUMS_HEADER = struct.Struct(">8sQ")
SUM_BLOCK = 4096            # the undo log's alignment (undo_log.ALIGN)
_READ = 1 << 20


def _header(fd: int) -> int | None:
    """The first log block a sums file covers (None: no valid header)."""
    raw = os.pread(fd, SUMS_HEADER.size, 0)
    if len(raw) < SUMS_HEADER.size:
        return None
    magic, first = SUMS_HEADER.unpack(raw)
    return first if magic == SUMS_MAGIC else None


def covered(fd: int) -> tuple[int, int]:
    """(first, end) log blocks the sums file open as *fd* holds digests of (end exclusive)."""
    first = _header(fd)
    if first is None:
        return 0, 0
    return first, first + (os.fstat(fd).st_size - SUMS_HEADER.size) // DIGEST


class SumsWriter:
    """Digests appended to a log's sums file as the log is appended (``undo_log._Appender``).
    Opened at the log's aligned end: digests past it are cut off, a file that cannot follow
    the log (none, another release's log, a log cut below it) starts again there."""

    def __init__(self, path: Path, log_end: int):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        block = log_end // SUM_BLOCK
        first, end = covered(self.fd)
        if _header(self.fd) is None or not first <= block <= end:
            os.pwrite(self.fd, SUMS_HEADER.pack(SUMS_MAGIC, block), 0)
            first = block
        self.at = SUMS_HEADER.size + (block - first) * DIGEST
        os.ftruncate(self.fd, self.at)
        self.pending = bytearray()

    def add(self, digests: bytes) -> None:
        self.pending += digests

    def add_data(self, data) -> None:
        """Digests of *data*, a whole number of 4 KiB log blocks as the log holds them."""
        self.pending += digest_blocks(data, SUM_BLOCK)

    def add_read(self, src: int, pos: int, length: int) -> None:
        """Digests of *length* bytes (4 KiB blocks) read from *src* at *pos*: what a reflink
        shared into the log (past the source's end: zeros, as the log reads there)."""
        done = 0
        while done < length:
            n = min(_READ, length - done)
            data = os.pread(src, n, pos + done)
            if len(data) < n:
                data += bytes(n - len(data))
            self.add_data(data)
            done += n

    def close(self, *, durable: bool = True) -> None:
        try:
            if self.pending:
                os.pwrite(self.fd, self.pending, self.at)
                self.at += len(self.pending)
                self.pending = bytearray()
            if durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def read_sums(path: Path | None, first: int, count: int) -> bytes | None:
    """The recorded digests of log blocks [first, first+count), or None when not all are."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        lo, hi = covered(fd)
        if not lo <= first or first + count > hi:
            return None
        return os.pread(fd, count * DIGEST, SUMS_HEADER.size + (first - lo) * DIGEST)
    finally:
        os.close(fd)


class RecordedSums:
    """A sums file read whole, for the many lookups of one fold."""

    def __init__(self, first: int, digests: bytes):
        self.first, self.digests = first, digests

    @classmethod
    def load(cls, path: Path) -> RecordedSums:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return cls(0, b"")
        try:
            first, end = covered(fd)
            return cls(first, os.pread(fd, (end - first) * DIGEST, SUMS_HEADER.size))
        finally:
            os.close(fd)

    def get(self, first: int, count: int) -> bytes | None:
        """The digests of log blocks [first, first+count), or None when not all are recorded."""
        lo = (first - self.first) * DIGEST
        hi = lo + count * DIGEST
        return self.digests[lo:hi] if first >= self.first and hi <= len(self.digests) else None


# -- checking -----------------------------------------------------------------------------
@dataclass
class MemberCheck:
    """What a check of one member of a point found: bad ranges ((offset in the volume,
    length, offset in the file) each), the bytes read, and the bytes it could not check."""
    bad: list = field(default_factory=list)
    bad_blocks: int = 0
    nread: int = 0
    unverifiable: int = 0


def _differing(actual: bytes, recorded: bytes) -> list[int]:
    import numpy as np
    a = np.frombuffer(actual, dtype="<u8").reshape(-1, DIGEST // 8)
    b = np.frombuffer(recorded, dtype="<u8").reshape(-1, DIGEST // 8)
    return np.flatnonzero((a != b).any(axis=1)).tolist()


def check_undo_window(log: Path, sums: Path, rows, first: int, count: int, out: MemberCheck) -> None:
    """Check log blocks [first, first+count) of the undo log at *log* against its sums;
    *rows*: the point's map, to name the volume offsets a bad block holds."""
    recorded = read_sums(sums, first, count)
    if recorded is None:
        out.unverifiable += count * SUM_BLOCK
        return
    fd = os.open(log, os.O_RDONLY)
    try:
        data = os.pread(fd, count * SUM_BLOCK, first * SUM_BLOCK)
    finally:
        os.close(fd)
    out.nread += len(data)
    data += bytes(count * SUM_BLOCK - len(data))          # a log cut short reads as zeros: a mismatch
    for i in _differing(digest_blocks(data, SUM_BLOCK), recorded):
        pos = (first + i) * SUM_BLOCK
        out.bad_blocks += 1
        # a block holds one range's bytes (ranges start at 4 KiB positions); none: only padding
        for off, length in volume_ranges(rows, pos, SUM_BLOCK) or [(-1, 0)]:
            out.bad.append((off, length, pos))


def volume_ranges(rows, pos: int, length: int) -> list[tuple[int, int]]:
    """The volume ranges whose bytes lie in log bytes [pos, pos+length) (map *rows*)."""
    got = []
    for off, ln, at in rows.tolist():
        if at < 0 or at >= pos + length or at + ln <= pos:
            continue
        lo, hi = max(at, pos), min(at + ln, pos + length)
        got.append((off + lo - at, hi - lo))
    return sorted(got)


def check_image_window(image: Path, mapfile: Path, first: int, count: int, out: MemberCheck,
                       buf: bytearray) -> None:
    """Check blocks [first, first+count) of a point's whole image against its block map."""
    if not mapfile.exists():
        out.unverifiable += count
        return
    with BlockMap.open(mapfile) as m:
        bs, size = m.block_size, m.size
        recorded = m.read(first, count)
    fd = os.open(image, os.O_RDONLY)
    try:
        actual, nread = hash_range(fd, first, count, bs, size, buf)
    finally:
        os.close(fd)
    out.nread += nread
    for i in _differing(actual, recorded):
        off = (first + i) * bs
        out.bad_blocks += 1
        out.bad.append((off, min(bs, size - off), off))


def image_blocks(mapfile: Path) -> tuple[int, int, int] | None:
    """(block size, image size, block count) of a point image's map; None: it has none."""
    try:
        with BlockMap.open(mapfile) as m:
            return m.block_size, m.size, block_count(m.size, m.block_size)
    except FileNotFoundError:
        return None


def record_image(image: Path, mapfile: Path, block_size: int) -> None:
    """Hash a point's whole image as built into its block map (written aside, renamed)."""
    tmp = mapfile.with_name("." + mapfile.name)
    fd = os.open(image, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(max(block_size, _READ - _READ % block_size))
        per = len(buf) // block_size
        with BlockMap.create(tmp, block_size, size) as m:
            for first in range(0, block_count(size, block_size), per):
                digests, _ = hash_range(fd, first, min(per, block_count(size, block_size) - first),
                                        block_size, size, buf)
                m.write(first, digests)
            m.fsync()
    finally:
        os.close(fd)
    os.replace(tmp, mapfile)


def record_built_image(image: Path, mapfile: Path, block_size: int, base: Path, laid) -> None:
    """The block map of a point image built from other points (a fold): *base*, a point
    image, reflinked, with the undo ranges *laid* ((log, map rows) each, disjoint) over it.
    Its digests are taken from what was recorded as those bytes were written (the base's
    map, the logs' sums), so damage in a source is not blessed by hashing it as built: a
    verify of the new image still finds it. A block no recorded digest describes exactly (a
    short block where the sizes differ, one laid from two ranges, a source without digests)
    is hashed as built."""
    base_map = PoolLayout.map_of_image(base)
    if block_size != SUM_BLOCK or not base_map.exists():
        record_image(image, mapfile, block_size)
        return
    import numpy as np
    size = os.stat(image).st_size
    nb = block_count(size, block_size)
    with BlockMap.open(base_map) as bm:
        same_blocks, base_size = bm.block_size == block_size, bm.size
        out = bytearray(bm.read(0, nb)) if same_blocks else bytearray()   # past its end: ZERO, as built
    if not same_blocks:                          # recorded at another block size: no slot is this one's
        record_image(image, mapfile, block_size)
        return
    rehash = np.zeros(nb, dtype=bool)
    if size != base_size:                        # short blocks: hashed short where each ends
        for end in (size, base_size):
            if end % block_size and end // block_size < nb:
                rehash[end // block_size] = True
    for log, rows in laid:
        _take_log_digests(out, rehash, RecordedSums.load(PoolLayout.sums_of_undo(log)), rows, size)
    _write_map(image, mapfile, block_size, size, out, rehash)


def _take_log_digests(out: bytearray, rehash, sums: RecordedSums, rows, size: int) -> None:
    """Into *out*: the digests of the image blocks the undo *rows* lay (volume offset,
    length, log position or -1 for zeros), from the log's recorded *sums*."""
    bs = SUM_BLOCK
    for off, ln, pos in rows.tolist():
        lim = min(off + ln, size)                 # the image's short last block is hashed short
        first, end = off // bs, block_count(lim, bs)
        whole_first, whole_end = block_count(off, bs), lim // bs
        rehash[first:whole_first] = True          # blocks the range only partly covers
        rehash[whole_end:end] = True
        if whole_end <= whole_first:
            continue
        if pos < 0:
            out[whole_first * DIGEST:whole_end * DIGEST] = ZERO * (whole_end - whole_first)
            continue
        got = sums.get((pos + whole_first * bs - off) // bs, whole_end - whole_first) \
            if (pos - off) % bs == 0 else None
        if got is None:
            rehash[whole_first:whole_end] = True
        else:
            out[whole_first * DIGEST:whole_end * DIGEST] = got


def _write_map(image: Path, mapfile: Path, block_size: int, size: int, digests: bytearray, rehash) -> None:
    """Write a point image's map from *digests*, hashing the blocks *rehash* marks (a bool
    array) from the image, a run at a time."""
    import numpy as np
    tmp = mapfile.with_name("." + mapfile.name)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], rehash, [False]]).astype(np.int8)))
    fd = os.open(image, os.O_RDONLY)
    try:
        buf = bytearray(_READ)
        per = _READ // block_size
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            for first in range(a, b, per):
                d, _ = hash_range(fd, first, min(per, b - first), block_size, size, buf)
                digests[first * DIGEST:first * DIGEST + len(d)] = d
        with BlockMap.create(tmp, block_size, size) as m:
            m.write(0, bytes(digests))
            m.fsync()
    finally:
        os.close(fd)
    os.replace(tmp, mapfile)


def record_sealed(layout: PoolLayout, unit_id: str, generation: int, volume_id: str) -> bool:
    """A seal's image is a reflink of the replica at *generation*: its digests are the
    receiver's recorded map of the replica, when that map describes this generation (copied,
    durably; nothing is read). False: no map describes it, the image stays unverifiable."""
    dst = layout.point_image_map(unit_id, generation, volume_id)
    st = find_state(layout.root, unit_id)
    maps = ReplicaMaps(layout, unit_id)
    if st is None or st.generation != generation or volume_id not in st.members or not maps.recorded_for(st):
        dst.unlink(missing_ok=True)
        return False
    tmp = dst.with_name("." + dst.name)
    tmp.unlink(missing_ok=True)          # a seal cut short before
    maps.copy_to(volume_id, tmp)
    os.replace(tmp, dst)
    return True


# -- what a verify checks of one member of a point -----------------------------------------
class PointMember:
    """One member of a kept point as a verify checks it: an undo log against its sums, or a
    whole image against its map. Built from the point's meta.json under the unit's lock;
    ``same`` tells, under the lock again, whether the point still keeps it that way (a commit
    between two windows may prune the point, or make the member a whole image)."""

    def __init__(self, layout: PoolLayout, unit_id: str, generation: int, volume_id: str, data: str, rows, *,
                 log_end: int = 0, data_bytes: int = 0):
        self.layout, self.unit_id, self.generation, self.volume_id = layout, unit_id, generation, volume_id
        self.data, self.rows = data, rows
        self.log_end, self.data_bytes = log_end, data_bytes      # an undo log's: where its map's bytes end, how many
        self.found = MemberCheck()
        if data == "undo":
            self.file = layout.point_undo(unit_id, generation, volume_id)
            self.sums = layout.point_undo_sums(unit_id, generation, volume_id)
        else:
            self.file = layout.point_image(unit_id, generation, volume_id)
            self.sums = layout.point_image_map(unit_id, generation, volume_id)

    def windows(self, window_bytes: int) -> list[tuple[int, int]]:
        """(first, count) of the blocks to check, a window at a time: log blocks of an undo
        log its sums cover (the rest counted unverifiable), blocks of an image with a map."""
        if self.data == "undo":
            end = -(-self.log_end // SUM_BLOCK)
            lo, hi = self._covered()
            lo, hi = min(lo, end), min(hi, end)
            self.found.unverifiable += self.data_bytes if hi <= lo else (end - (hi - lo)) * SUM_BLOCK
            return _split(lo, hi, max(1, window_bytes // SUM_BLOCK))
        shape = image_blocks(self.sums)
        if shape is None:
            self.found.unverifiable += _size(self.file)
            return []
        bs, _size_, count = shape
        return _split(0, count, max(1, window_bytes // bs))

    def _covered(self) -> tuple[int, int]:
        try:
            fd = os.open(self.sums, os.O_RDONLY)
        except FileNotFoundError:
            return 0, 0
        try:
            return covered(fd)
        finally:
            os.close(fd)

    def check(self, first: int, count: int, buf: bytearray) -> int:
        """Check one window; the bytes read."""
        before = self.found.nread
        if self.data == "undo":
            check_undo_window(self.file, self.sums, self.rows, first, count, self.found)
        else:
            check_image_window(self.file, self.sums, first, count, self.found, buf)
        return self.found.nread - before


def _split(lo: int, hi: int, per: int) -> list[tuple[int, int]]:
    return [(f, min(per, hi - f)) for f in range(lo, hi, per)]


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
