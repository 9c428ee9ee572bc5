"""The journal's digest file (``replicamap.JournalDigests``): what is written is read back,
across the reader's buffer boundaries; a torn tail ends the listing; a file of another
boot lists nothing."""
import os
import random

from drsvc.replication import replicamap
from drsvc.replication.blockmap import digest_blocks
from drsvc.replication.replicamap import DIGESTS_HEADER, JournalDigests


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
    assert member == replicamap.UNUSABLE and digests == b""


def test_a_file_written_in_another_boot_lists_nothing(tmp_path, monkeypatch):
    _write(tmp_path / "d.bin", random.Random(5), 5)
    monkeypatch.setattr(replicamap, "boot_id", lambda: "another-boot")
    assert list(JournalDigests.entries(tmp_path / "d.bin")) == []
    with open(tmp_path / "e.bin", "wb") as f:          # no header at all (an older receiver's)
        f.write(b"\0" * DIGESTS_HEADER.size)
    assert list(JournalDigests.entries(tmp_path / "e.bin")) == []
