"""Block maps and zero detection."""
import os

import pytest

from drsvc.replication.common import blockmap as bm
from drsvc.layout import PoolLayout, check_id
from drsvc.errors import InvalidName, MissingField

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def test_zero_blocks_get_the_zero_sentinel():
    data = bytes(4096) + os.urandom(4096) + bytes(100)
    d = bm.digest_blocks(data, 4096)
    assert len(d) == 48
    assert d[:16] == bm.ZERO and d[16:32] != bm.ZERO and d[32:] == bm.ZERO
    assert bm.block_digest(b"\0" * 4095 + b"\1") != bm.ZERO


def test_map_file_round_trip_resize_and_clear(tmp_path):
    p = tmp_path / "m.map"
    with bm.BlockMap.create(p, 4096, 10 * 4096 + 1) as m:
        assert m.blocks == 11
        m.write(3, b"\x01" * 32)
    with bm.BlockMap.open(p, writable=True) as m:
        assert m.size == 10 * 4096 + 1
        assert m.read(2, 3) == bm.ZERO + b"\x01" * 32
        assert m.read(10, 4) == bm.ZERO * 4   # past the end reads as zero
        m.clear(4, 1)
        assert m.read(3, 2) == b"\x01" * 16 + bm.ZERO
        m.resize(2 * 4096)
        assert m.blocks == 2 and os.path.getsize(p) == bm.HEADER.size + 32
    (tmp_path / "bad.map").write_bytes(b"garbage" * 10)
    from drsvc.errors import CorruptMetadata
    with pytest.raises(CorruptMetadata):
        bm.BlockMap.open(tmp_path / "bad.map")


def test_hash_image_skips_holes(tmp_path):
    p = tmp_path / "img"
    with open(p, "wb") as f:
        f.truncate(16 << 20)
        f.seek(5 << 20)
        f.write(os.urandom(8192))
    fd = os.open(p, os.O_RDONLY)
    try:
        got = list(bm.hash_image(fd, 16 << 20, 4096))
    finally:
        os.close(fd)
    firsts = [first for first, _ in got]
    total = sum(len(d) // 16 for _, d in got)
    assert total < 512 and (5 << 20) // 4096 in firsts


def test_punch_hole_zeroes_range(tmp_path):
    p = tmp_path / "img"
    p.write_bytes(os.urandom(3 * 4096))
    fd = os.open(p, os.O_RDWR)
    try:
        bm.punch_hole(fd, 4096, 4096)
        assert os.pread(fd, 4096, 4096) == bytes(4096) and os.fstat(fd).st_size == 3 * 4096
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "-x", "x" * 129, "a b", ".hidden", None])
def test_ids_cannot_escape_the_pool(bad, tmp_path):
    # named errors: an empty id is a missing field, anything else unsafe an invalid name
    err = MissingField if bad == "" else InvalidName
    with pytest.raises(err):
        check_id(bad)
    with pytest.raises(err):
        PoolLayout(tmp_path).image(bad)


def test_good_ids():
    for ok in ["pvc-1234", "a", "A.b_c-d", "x" * 128]:
        assert check_id(ok) == ok


def test_block_size_bounds():
    assert bm.check_block_size(4096) == 4096
    for bad in (100, 3000, 2 << 20):
        with pytest.raises(ValueError):
            bm.check_block_size(bad)


def test_gathered_slot_writes_equal_direct_writes(tmp_path):
    """Writes are gathered per map page; what lands in the file (and what read()
    sees meanwhile) equals writing each run straight, byte for byte, including
    runs that straddle pages, a full-page run and the eviction of dirty pages."""
    import random

    from drsvc.replication.common import blockmap
    rnd = random.Random(7)
    bs, size = 4096, 4096 * 70_000 + 100          # ~1.1 MiB of slots: 17 map pages, short tail
    ref = bytearray(blockmap.HEADER.size + blockmap.block_count(size, bs) * blockmap.DIGEST)
    m = blockmap.BlockMap.create(tmp_path / "m.map", bs, size)
    ref[:blockmap.HEADER.size] = os.pread(m.fd, blockmap.HEADER.size, 0)
    old = blockmap.MAX_DIRTY
    blockmap.MAX_DIRTY = 3                          # force evictions mid-way
    try:
        for i in range(3000):
            first = rnd.randrange(m.blocks)
            count = min(m.blocks - first, rnd.choice([1, 3, 300, 5000]))
            d = rnd.randbytes(count * blockmap.DIGEST)
            m.write(first, d)
            pos = blockmap.HEADER.size + first * blockmap.DIGEST
            ref[pos:pos + len(d)] = d
            if i % 500 == 0:
                probe = rnd.randrange(m.blocks)
                p = blockmap.HEADER.size + probe * blockmap.DIGEST
                assert m.read(probe, 1) == bytes(ref[p:p + blockmap.DIGEST])
    finally:
        blockmap.MAX_DIRTY = old
    m.close()
    assert (tmp_path / "m.map").read_bytes() == bytes(ref)
