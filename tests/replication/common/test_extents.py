"""The pure FIEMAP struct parser, and the ioctl on a real XFS file."""
import os
import struct

import pytest

from drsvc.host import fiemap as fm


def fake_reply(extents, count=None):
    count = count if count is not None else len(extents)
    buf = bytearray(fm.HEADER.size + count * fm.EXTENT.size)
    fm.HEADER.pack_into(buf, 0, 0, 2**64 - 1, 0, len(extents), count, 0)
    for i, (lo, ph, ln, fl) in enumerate(extents):
        fm.EXTENT.pack_into(buf, fm.HEADER.size + i * fm.EXTENT.size, lo, ph, ln, 0, 0, fl, 0, 0, 0)
    return buf


def test_struct_sizes_match_the_kernel():
    assert fm.HEADER.size == 32 and fm.EXTENT.size == 56


def test_parse_extents():
    buf = fake_reply([(0, 4096 * 10, 8192, 0), (65536, 1 << 30, 4096, fm.FIEMAP_EXTENT_LAST | fm.FIEMAP_EXTENT_SHARED)],
                     count=8)
    ex = fm.parse_reply(buf)
    assert ex == [fm.Extent(0, 40960, 8192, 0),
                  fm.Extent(65536, 1 << 30, 4096, fm.FIEMAP_EXTENT_LAST | fm.FIEMAP_EXTENT_SHARED)]
    assert ex[1].last and not ex[0].last and ex[0].end == 8192


def test_build_request_layout():
    buf = fm.build_request(4096, 1 << 20, 16)
    start, length, flags, mapped, count, _ = fm.HEADER.unpack_from(buf)
    assert (start, length, flags, mapped, count) == (4096, 1 << 20, fm.FIEMAP_FLAG_SYNC, 0, 16)
    assert len(buf) == 32 + 16 * 56


def test_parse_rejects_inconsistent_counts():
    buf = fake_reply([(0, 0, 4096, 0)] * 3, count=3)
    struct.pack_into("=I", buf, 20, 2)   # fm_mapped_extents > fm_extent_count
    struct.pack_into("=I", buf, 24, 1)
    with pytest.raises(ValueError):
        fm.parse_reply(buf)
    with pytest.raises(ValueError):
        fm.parse_reply(b"\0" * 8)


def test_fiemap_on_xfs_sees_shared_and_rewritten_extents(xfs_dir):
    from drsvc.host.reflink import clone_file
    a = xfs_dir / "a.img"
    with open(a, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.truncate(4 << 20)
    clone_file(a, xfs_dir / "b.img")
    fd = os.open(a, os.O_RDWR)
    os.pwrite(fd, os.urandom(4096), 8192)
    os.fsync(fd)
    ea = fm.fiemap(fd, 4 << 20)
    fdb = os.open(xfs_dir / "b.img", os.O_RDONLY)
    eb = fm.fiemap(fdb, 4 << 20)
    os.close(fd)
    os.close(fdb)
    assert sum(e.length for e in ea) == 1 << 20 and sum(e.length for e in eb) == 1 << 20
    from drsvc.replication.common.extents import shared_intervals
    from drsvc.replication.common import ranges
    changed = ranges.pairs(ranges.subtract(ranges.from_pairs([(0, 1 << 20)]), ranges.from_pairs(shared_intervals(ea, eb))))
    assert changed == [(8192, 12288)]
