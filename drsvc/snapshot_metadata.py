"""Changed-block metadata of snapshots (CSI SnapshotMetadata): allocated and delta ranges.

Snapshots are immutable reflink copies, so FIEMAP decides most of the answer:
a range that both snapshots map to the same physical blocks at the same
offset is unchanged, and a range that is a hole in both reads as zeros in both.
Everything else is undecided by the extent maps alone (a block rewritten with
the same bytes, zero-filled data against a hole, data that a restored or
cloned volume shares with another image at a different offset), so those
blocks are compared: both snapshots are local, so the comparison is exact,
4 KiB block by block, and only the candidate ranges are read.

GetMetadataAllocated reports the blocks that hold data: FIEMAP's data
extents, less blocks that read as zeros.

Ranges are yielded in ascending order, merged, as (byte_offset, size_bytes),
and never end at or before the requested starting offset. Nothing here
imports grpc: the servicer shapes the stream.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import BaseNewerThanTarget, SnapshotsOfDifferentVolumes, StartingOffsetOutOfRange
from .host.fiemap import fiemap
from .ids import check_id
from .model import Snapshot
from .replication.common import clip, data_intervals, from_pairs, pairs, round_out, shared_intervals, subtract
from .volumes import VolumeService

log = logging.getLogger(__name__)
BLOCK = 4096
CHUNK = 8 << 20                 # bytes read per comparison step
_ZERO = bytes(CHUNK)
Range = tuple[int, int]         # (byte_offset, size_bytes)


@dataclass(frozen=True)
class Metadata:
    capacity_bytes: int
    ranges: Iterator[Range]


def _extents(fd: int, size: int) -> list | None:
    try:
        return fiemap(fd, size)
    except OSError as e:                    # no FIEMAP here: every block is a candidate
        log.warning("FIEMAP unavailable (%s): comparing whole images", e)
        return None


def _candidates(r, size: int, start: int) -> list[tuple[int, int]]:
    """The ranges *r* rounded out to whole blocks, from the block holding *start* on."""
    first = start - start % BLOCK
    return pairs(clip(round_out(r, BLOCK, size), first, size))


def _pread_full(fd: int, offset: int, length: int) -> bytes:
    parts, got = [], 0
    while got < length:
        b = os.pread(fd, length - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    data = b"".join(parts)
    return data + bytes(length - len(data)) if len(data) < length else data


def _runs(candidates, differs) -> Iterator[Range]:
    """Merged runs of blocks inside *candidates* for which differs(offset, a, b) holds."""
    run_start = run_end = -1
    for s, e in candidates:
        for off in range(s, e, CHUNK):
            n = min(CHUNK, e - off)
            mask = differs(off, n)
            for i, changed in enumerate(mask):
                b = off + i * BLOCK
                if not changed:
                    continue
                if b == run_end:
                    run_end = min(b + BLOCK, e)
                else:
                    if run_start >= 0:
                        yield run_start, run_end - run_start
                    run_start, run_end = b, min(b + BLOCK, e)
    if run_start >= 0:
        yield run_start, run_end - run_start


def _block_mask(a: bytes, b: bytes | None) -> list[bool]:
    """Per 4 KiB block: does *a* differ from *b* (or from zeros when b is None)?"""
    if b is None:
        if a == _ZERO[:len(a)]:
            return [False] * (-(-len(a) // BLOCK))
        return [a[i:i + BLOCK] != _ZERO[:len(a[i:i + BLOCK])] for i in range(0, len(a), BLOCK)]
    if a == b:
        return [False] * (-(-len(a) // BLOCK))
    return [a[i:i + BLOCK] != b[i:i + BLOCK] for i in range(0, len(a), BLOCK)]


class SnapshotMetadataService:
    def __init__(self, volumes: VolumeService):
        self.volumes = volumes
        self.pool = volumes.pool

    def _snapshot(self, snapshot_id: str, what: str) -> Snapshot:
        check_id(snapshot_id, what)
        return self.volumes.get_snapshot(snapshot_id)

    @staticmethod
    def _check_offset(offset: int, size: int) -> None:
        if offset < 0 or offset > size:
            raise StartingOffsetOutOfRange(offset=offset, size=size)

    def allocated(self, snapshot_id: str, starting_offset: int = 0) -> Metadata:
        snap = self._snapshot(snapshot_id, "snapshot_id")
        path = self.pool.snapshot_image(snap.snapshot_id)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._check_offset(starting_offset, size)
            ext = _extents(fd, size)
        except BaseException:
            os.close(fd)
            raise
        data = data_intervals(ext, size) if ext is not None else [(0, size)]
        candidates = _candidates(from_pairs(data), size, starting_offset)

        def gen():
            try:
                yield from _runs(candidates, lambda off, n: _block_mask(_pread_full(fd, off, n), None))
            finally:
                os.close(fd)
        return Metadata(size, gen())

    def delta(self, base_snapshot_id: str, target_snapshot_id: str, starting_offset: int = 0) -> Metadata:
        base = self._snapshot(base_snapshot_id, "base_snapshot_id")
        target = self._snapshot(target_snapshot_id, "target_snapshot_id")
        if base.source_volume_id != target.source_volume_id:
            raise SnapshotsOfDifferentVolumes(base=base.snapshot_id, base_volume=base.source_volume_id,
                                              target=target.snapshot_id, target_volume=target.source_volume_id)
        if base.created_at > target.created_at:
            raise BaseNewerThanTarget(base=base.snapshot_id, target=target.snapshot_id)
        fds = []
        try:
            for s in (target, base):
                fds.append(os.open(self.pool.snapshot_image(s.snapshot_id), os.O_RDONLY))
            tfd, bfd = fds
            size, base_size = os.fstat(tfd).st_size, os.fstat(bfd).st_size
            self._check_offset(starting_offset, size)
            t_ext, b_ext = _extents(tfd, size), _extents(bfd, base_size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if t_ext is None or b_ext is None:
            candidates = from_pairs([(0, size)])
        else:
            both = from_pairs(data_intervals(t_ext, size) + data_intervals(b_ext, min(base_size, size)))
            candidates = subtract(both, from_pairs(shared_intervals(t_ext, b_ext)))
        candidates = _candidates(candidates, size, starting_offset)

        def differs(off: int, n: int) -> list[bool]:
            new = _pread_full(tfd, off, n)
            old = _pread_full(bfd, off, max(0, min(n, base_size - off)))
            return _block_mask(new, old + bytes(n - len(old)))

        def gen():
            try:
                yield from _runs(candidates, differs)
            finally:
                for fd in fds:
                    os.close(fd)
        return Metadata(size, gen())


def fixed_length(ranges: Iterator[Range], block: int = BLOCK) -> Iterator[Range]:
    """The same ranges as FIXED_LENGTH tuples of *block* bytes (the last block of an
    image whose size is not a multiple is still reported as one full block)."""
    for off, n in ranges:
        first = off - off % block
        for b in range(first, off + n, block):
            yield b, block
