"""Per-block hash maps and zero detection.

A block map is a small binary file: a 32-byte header (magic, version, block
size, image size, block count) followed by one 16-byte xxh3-128 digest per
block. All-zero blocks and holes are stored as 16 zero bytes, so a map of a
thin image is itself sparse, and maps are read and written by slot range
(never loaded whole: a 1 TiB image has a 4 GiB map).
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
from functools import lru_cache
from pathlib import Path

import xxhash

from ...errors import CorruptMetadata
from ...host.libc import libc
from ...host.reflink import clone_file, data_ranges

DIGEST = 16
ZERO = bytes(DIGEST)
HEADER = struct.Struct(">8sIIQQ")
MAGIC = b"DRBLKMAP"
MAP_VERSION = 1
DEFAULT_BLOCK_SIZE = 4096
MIN_BLOCK_SIZE = 512
MAX_BLOCK_SIZE = 1 << 20
MAP_PAGE = 64 << 10          # writes are gathered per page of the map file ...
MAX_DIRTY = 256              # ... up to this many pages (16 MiB) before they go out

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = None


def check_block_size(bs: int) -> int:
    if not (MIN_BLOCK_SIZE <= bs <= MAX_BLOCK_SIZE) or bs & (bs - 1):
        raise ValueError(f"block size {bs} must be a power of two in [512, 1 MiB]")
    return bs


def block_count(size: int, block_size: int) -> int:
    return -(-size // block_size)


@lru_cache(maxsize=64)
def _zero_digest(n: int) -> bytes:
    return xxhash.xxh3_128_digest(bytes(n))


@lru_cache(maxsize=8)
def zeros(n: int) -> bytes:
    return bytes(n)


def block_digest(block) -> bytes:
    """Digest of one block; ZERO when the block is all zeros."""
    d = xxhash.xxh3_128_digest(block)
    if d == _zero_digest(len(block)) and block == zeros(len(block)):
        return ZERO
    return d


def digest_blocks(buf, block_size: int) -> bytes:
    """Concatenated digests of consecutive blocks of *buf* (the last may be short)."""
    mv = memoryview(buf)
    h = xxhash.xxh3_128_digest
    zd = _zero_digest(block_size)
    out = []
    append = out.append
    n = len(mv)
    for i in range(0, n, block_size):
        blk = mv[i:i + block_size]
        d = h(blk)
        if len(blk) == block_size:
            if d == zd and blk == zeros(block_size):
                d = ZERO
        elif d == _zero_digest(len(blk)) and blk == zeros(len(blk)):
            d = ZERO
        append(d)
    return b"".join(out)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate a range (it reads back as zeros); write zeros where punching is unsupported."""
    global _libc
    if length <= 0:
        return
    if _libc is None:
        _libc = libc()
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(err, os.strerror(err))
    chunk = zeros(1 << 20)
    end = offset + length
    while offset < end:
        n = min(len(chunk), end - offset)
        os.pwrite(fd, chunk[:n], offset)
        offset += n


class BlockMap:
    """An open block map file; slots are read and written by range."""

    def __init__(self, path: Path, fd: int, block_size: int, size: int, writable: bool):
        self.path = Path(path)
        self.fd = fd
        self.block_size = block_size
        self.size = size
        self.writable = writable
        # Slot writes gathered by map page: a reflinked map (copied from the base)
        # pays a copy-on-write per write call, and a 10% change has ~25,000 runs.
        self._dirty: dict[int, bytearray] = {}

    @property
    def blocks(self) -> int:
        return block_count(self.size, self.block_size)

    # -- lifecycle
    @classmethod
    def create(cls, path: Path, block_size: int, size: int) -> BlockMap:
        check_block_size(block_size)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        m = cls(path, fd, block_size, size, True)
        m._write_header()
        os.ftruncate(fd, HEADER.size + m.blocks * DIGEST)
        return m

    @classmethod
    def open(cls, path: Path, *, writable: bool = False) -> BlockMap:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            raw = os.pread(fd, HEADER.size, 0)
            if len(raw) != HEADER.size:
                raise CorruptMetadata(path=str(path), reason="short block map header")
            magic, version, bs, size, n = HEADER.unpack(raw)
            if magic != MAGIC or version != MAP_VERSION or n != block_count(size, bs):
                raise CorruptMetadata(path=str(path), reason="bad block map header")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, bs, size, writable)

    @classmethod
    def empty(cls, block_size: int) -> EmptyMap:
        return EmptyMap(block_size)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                self.flush()
            finally:
                os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write_header(self) -> None:
        os.pwrite(self.fd, HEADER.pack(MAGIC, MAP_VERSION, self.block_size, self.size, self.blocks), 0)

    def resize(self, size: int) -> None:
        """Change the image size; new slots read as ZERO (a grown image reads zeros there)."""
        self.flush()
        old_blocks = self.blocks
        self.size = size
        new_blocks = self.blocks
        if new_blocks < old_blocks or new_blocks > old_blocks:
            os.ftruncate(self.fd, HEADER.size + new_blocks * DIGEST)
        self._write_header()

    def flush(self) -> None:
        """Write the gathered pages, in file order."""
        for page in sorted(self._dirty):
            os.pwrite(self.fd, self._dirty[page], page * MAP_PAGE)
        self._dirty.clear()

    def fsync(self) -> None:
        self.flush()
        os.fsync(self.fd)

    # -- slots
    def read(self, first: int, count: int) -> bytes:
        """Digests of blocks [first, first+count); slots past the end read as ZERO."""
        if self._dirty:
            self.flush()
        avail = max(0, min(count, self.blocks - first))
        data = os.pread(self.fd, avail * DIGEST, HEADER.size + first * DIGEST) if avail else b""
        if len(data) < count * DIGEST:
            data += bytes(count * DIGEST - len(data))
        return data

    def write(self, first: int, digests: bytes) -> None:
        pos = HEADER.size + first * DIGEST
        if len(digests) >= MAP_PAGE:         # large runs (a full scan) go straight out
            self.flush()
            os.pwrite(self.fd, digests, pos)
            return
        end = pos + len(digests)
        limit = HEADER.size + self.blocks * DIGEST
        src = 0
        while pos < end:
            page, rel = divmod(pos, MAP_PAGE)
            buf = self._dirty.get(page)
            if buf is None:
                if len(self._dirty) >= MAX_DIRTY:
                    self.flush()
                base = page * MAP_PAGE
                buf = bytearray(os.pread(self.fd, min(MAP_PAGE, max(limit, end) - base), base))
                self._dirty[page] = buf
            n = min(end - pos, MAP_PAGE - rel)
            if rel + n > len(buf):
                buf.extend(bytes(rel + n - len(buf)))
            buf[rel:rel + n] = digests[src:src + n]
            pos += n
            src += n

    def clear(self, first: int, count: int) -> None:
        self.flush()
        count = min(count, self.blocks - first)
        if count > 0:
            punch_hole(self.fd, HEADER.size + first * DIGEST, count * DIGEST)


class EmptyMap:
    """The map of an image that does not exist yet: every block reads as ZERO."""

    size = 0
    blocks = 0

    def __init__(self, block_size: int):
        self.block_size = block_size

    def read(self, first: int, count: int) -> bytes:
        return bytes(count * DIGEST)

    def close(self) -> None:
        pass


def copy_map(src: Path, dst: Path) -> None:
    """Copy a block map file (reflink when possible; it is sparse-aware otherwise)."""
    clone_file(Path(src), Path(dst), fsync=False)


def hash_range(fd: int, first: int, count: int, block_size: int, size: int, buf: bytearray) -> tuple[bytes, int]:
    """Digests of blocks [first, first+count) of an image of *size* bytes, read into *buf* (a
    multiple of the block size); holes read as ZERO without a read. Returns the digests and
    the bytes read."""
    out = bytearray(count * DIGEST)
    mv = memoryview(buf)
    start, end = first * block_size, min(size, (first + count) * block_size)
    nread = 0
    for off, length in data_ranges(fd, end, start=start):
        pos = off - off % block_size
        stop = min(end, block_count(off + length, block_size) * block_size)
        while pos < stop:
            n = min(len(buf), stop - pos)
            got = os.preadv(fd, [mv[:n]], pos)
            if got < n:
                mv[got:n] = bytes(n - got)
            slot = (pos - start) // block_size * DIGEST
            d = digest_blocks(mv[:n], block_size)
            out[slot:slot + len(d)] = d
            nread += n
            pos += n
    return bytes(out), nread


def hash_image(fd: int, size: int, block_size: int, *, chunk: int = 1 << 20):
    """Yield (first_block, digests) for the data regions of an image; holes are skipped."""
    chunk = max(chunk - chunk % block_size, block_size)
    buf = bytearray(chunk)
    mv = memoryview(buf)
    for off, length in data_ranges(fd, size):
        start = off - off % block_size
        end = min(size, block_count(off + length, block_size) * block_size)
        pos = start
        while pos < end:
            n = min(chunk, end - pos)
            got = os.preadv(fd, [mv[:n]], pos)
            if got < n:
                mv[got:n] = bytes(n - got)
            yield pos // block_size, digest_blocks(mv[:n], block_size)
            pos += n
