"""The journal's digest file (``replica_maps.JournalDigests``): what is written is read back,
across the reader's buffer boundaries; a torn tail ends the listing; a file of another
boot lists nothing."""
import errno
import os
import random

import pytest

from drsvc.replication.common import replica_maps
from drsvc.replication.common.blockmap import digest_blocks
from drsvc.replication.common.replica_maps import DIGESTS_HEADER, JournalDigests

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def _write(path, rnd, n):
    jd = JournalDigests(path)
    jd.reset()
    want = []
    for i in range(n):
        blocks = rnd.choice([1, 1, 3, 256, 4000])        # up to 64,000 bytes of digests an entry
        data = rnd.randbytes(blocks * 512)
        off = rnd.randrange(0, 1 << 20) * 512
        jd.add(i % 3, off, 512, JournalDigests.digest(off, 512, data))
        want.append((i % 3, off // 512, digest_blocks(data, 512)))
    jd.flush()
    jd.close()
    return want


def test_entries_read_back_across_buffer_boundaries(tmp_path):
    want = _write(tmp_path / "d.bin", random.Random(3), 400)
    assert os.path.getsize(tmp_path / "d.bin") > 3 << 20
    assert list(JournalDigests.entries(tmp_path / "d.bin")) == want


def test_a_torn_tail_ends_the_listing(tmp_path):
    want = _write(tmp_path / "d.bin", random.Random(4), 50)
    size = os.path.getsize(tmp_path / "d.bin")
    os.truncate(tmp_path / "d.bin", size - 7)
    assert list(JournalDigests.entries(tmp_path / "d.bin")) == want[:-1]


def test_an_unaligned_record_is_marked_unusable(tmp_path):
    jd = JournalDigests(tmp_path / "d.bin")
    jd.reset()
    jd.add(0, 100, 512, JournalDigests.digest(100, 512, b"x" * 512))
    jd.close()
    [(member, _first, digests)] = list(JournalDigests.entries(tmp_path / "d.bin"))
    assert member == replica_maps.UNUSABLE and digests == b""


def test_a_file_written_in_another_boot_lists_nothing(tmp_path, monkeypatch):
    _write(tmp_path / "d.bin", random.Random(5), 5)
    monkeypatch.setattr(replica_maps, "boot_id", lambda: "another-boot")
    assert list(JournalDigests.entries(tmp_path / "d.bin")) == []
    with open(tmp_path / "e.bin", "wb") as f:          # no header at all (an older receiver's)
        f.write(b"\0" * DIGESTS_HEADER.size)
    assert list(JournalDigests.entries(tmp_path / "e.bin")) == []


def _maps_after(tmp_path, records):
    """A unit's replica map of one member (16 blocks, every one data) after *records*, as
    ``ReplicaMaps.apply`` takes them: (member, is_zero, offset, length, data or None)."""
    from drsvc.replication.common.blockmap import BlockMap
    from drsvc.layout import PoolLayout
    layout = PoolLayout(tmp_path / "pool")
    maps = replica_maps.ReplicaMaps(layout, "u")
    maps.dir.mkdir(parents=True, exist_ok=True)
    layout.images.mkdir(parents=True)
    layout.image("v").write_bytes(b"")
    os.truncate(layout.image("v"), 16 * 4096)
    bm = BlockMap.create(maps.path("v"), 4096, 16 * 4096)
    bm.write(0, digest_blocks(b"\1" * 16 * 4096, 4096))
    bm.close()
    jd = JournalDigests(tmp_path / "d.bin")
    jd.reset()
    for member, z, off, _length, data in records:
        if not z:
            jd.add(member, off, 4096, JournalDigests.digest(off, 4096, data))
    jd.close()
    tx = {"block_size": 4096, "target": 2, "txid": "t", "members": [{"volume_id": "v", "size": 16 * 4096,
                                                                    "fresh": False}]}
    assert maps.apply(tx, tmp_path / "d.bin", [(m, z, o, n) for m, z, o, n, _d in records])
    bm = BlockMap.open(maps.path("v"))
    try:
        return bm.read(0, 16)
    finally:
        bm.close()


def test_records_on_one_block_take_the_maps_in_arrival_order(tmp_path):
    """An early plan (``capture_feed``) sends a block again later in the plan when it was written
    after its clone: a zero record then data, or data then zero, and the later one is what the
    replica holds, so it is what its map must say."""
    new = b"\2" * 4096
    d = _maps_after(tmp_path / "a", [(0, True, 4096, 4096, None), (0, False, 4096, 4096, new)])
    assert d[16:32] == digest_blocks(new, 4096)
    d = _maps_after(tmp_path / "b", [(0, False, 4096, 4096, new), (0, True, 4096, 4096, None)])
    assert d[16:32] == bytes(16)
    d = _maps_after(tmp_path / "c", [(0, False, 0, 8192, b"\3" * 8192), (0, False, 4096, 4096, new)])
    assert d[:32] == digest_blocks(b"\3" * 4096, 4096) + digest_blocks(new, 4096)


def test_a_full_filesystem_refusing_the_last_flush_does_not_stop_a_discard():
    """/dev/full answers every write with ENOSPC, as a DR pool with no room left: a
    transaction that fails there discards its journal, and closing the digests it was about
    to remove must not raise (the removal is what frees the pool). Kept, the error stands."""
    jd = JournalDigests("/dev/full")
    jd.add(0, 0, 512, JournalDigests.digest(0, 512, bytes(512)))
    jd.close(keep=False)
    jd.close(keep=False)                 # repeat-safe: nothing is left open
    jd.add(0, 0, 512, JournalDigests.digest(0, 512, bytes(512)))
    with pytest.raises(OSError) as e:
        jd.close()
    assert e.value.errno == errno.ENOSPC
    jd.close()                           # the descriptor went with the failed close
