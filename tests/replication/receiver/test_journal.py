"""The receiver's journal writes each large payload once: into data.bin, from where apply
reflinks the ranges into the image (FICLONERANGE); a range under 64 KiB is copied. On a
pool without reflink (ext4) it copies them all. Either way the image ends up exactly the target, and a replay
of the same committed journal is harmless."""
import os
import time

import pytest

from drsvc.replication.wire import frames
from drsvc.replication.receiver.journal import ENTRY, Journal
from drsvc.layout import PoolLayout
from tests.fixtures.xfs import loop_mounted_fs, need

from ..conftest import make_image

MiB = 1 << 20
BS = 64 << 10


def _tx(size):
    return {"txid": "t1", "unit": "v", "kind": "volume", "base": 1, "target": 2, "epoch": 0,
            "block_size": BS, "mode": "delta", "force": False, "demote": False, "peer": None,
            "origin": None, "members": [{"volume_id": "v", "size": size, "base_size": size, "fresh": False}]}


def _fresh_journal(root, size):
    """A pool with image "v" of *size* and a new journal of one transaction on it."""
    lay = PoolLayout(root)
    (lay.root / "images").mkdir(parents=True)
    make_image(lay.image("v"), size)
    lay.ensure_unit_dir("v")
    j = Journal(lay, "v")
    j.create(_tx(size))
    return lay, j


def _journal_and_apply(root, size):
    lay = PoolLayout(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    img = lay.image("v")
    make_image(img, size, [(0, os.urandom(size))])
    want = bytearray(img.read_bytes())
    lay.ensure_unit_dir("v")
    j = Journal(lay, "v")
    j.create(_tx(size))
    edits = [(3 * BS, os.urandom(BS)), (9 * BS, os.urandom(4 * BS)), (20 * BS, None),
             (30 * BS, os.urandom(4096)),                # under 64 KiB: copied, no extent made
             (size - 1000, os.urandom(1000))]            # an unaligned tail: copied
    for off, data in edits:
        length = len(data) if data is not None else BS
        codec = frames.CODEC_ZERO if data is None else frames.CODEC_RAW
        ck = 0 if data is None else frames.payload_checksum(data)
        j.append(frames.RecordHeader(0, codec, off, length, ck), data)
        want[off:off + length] = data if data is not None else bytes(length)
    j.mark_committed(j.chain.count, j.chain.hexdigest())
    assert os.path.getsize(j.records_path) == 5 * ENTRY.size, "no payload in records.bin"
    first = j.apply()
    assert img.read_bytes() == want
    again = Journal(lay, "v")
    assert again.load() and again.committed()
    again.apply()                                         # a replay converges on the same bytes
    assert img.read_bytes() == want
    return first


def test_apply_reflinks_each_payload_written_once(xfs_mod):
    root = xfs_mod / "journal-xfs"
    got = _journal_and_apply(root, 2 * MiB + 1000)
    assert got.cloned == 5 * BS and got.copied == 4096 + 1000


def test_apply_copies_where_the_pool_has_no_reflink(tmp_path):
    need("mkfs.ext4")
    with loop_mounted_fs("256M", fstype="ext4") as mnt:
        got = _journal_and_apply(mnt / "pool", 2 * MiB + 1000)
    assert got.cloned == 0 and got.copied == 5 * BS + 4096 + 1000


def test_resume_scan_cuts_a_torn_data_tail(xfs_mod):
    lay, j = _fresh_journal(xfs_mod / "journal-scan", 2 * MiB)
    for i in range(3):
        d = os.urandom(BS)
        j.append(frames.RecordHeader(0, frames.CODEC_RAW, i * BS, BS, frames.payload_checksum(d)), d)
    j.sync()
    j.close()
    with open(j.data_path, "r+b") as f:       # the last payload torn by a crash
        f.truncate(2 * BS + 100)
    k = Journal(lay, "v")
    assert k.load()
    assert k.scan() == 2
    assert os.path.getsize(k.data_path) == 2 * BS
    assert not k.committed()


def test_killed_receiver_keeps_an_index_to_resume_from(xfs_mod):
    """No sync, no close: what a SIGKILL leaves. The record headers must have reached the
    kernel with their payloads (about every MiB), else the next attempt resumes from zero."""
    lay, j = _fresh_journal(xfs_mod / "journal-kill", 8 * MiB)
    for i in range(64):                        # 4 MiB of payload in 64 KiB records
        d = os.urandom(BS)
        j.append(frames.RecordHeader(0, frames.CODEC_RAW, i * BS, BS, frames.payload_checksum(d)), d)
    # payloads are written by the journal's writer thread, at most _Writer.LIMIT behind:
    # what it has written by the kill is what the kernel has
    j._writer.drain()
    k = Journal(lay, "v")                      # another process's view: only what reached the kernel
    assert k.load()
    assert k.scan() >= 48


def _flushes(mnt) -> int:
    """Flush requests completed by the block device under *mnt* (/sys/dev/block/*/stat)."""
    dev = os.stat(mnt).st_dev
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
        return int(f.read().split()[15])


def test_payloads_are_made_durable_while_the_stream_arrives(xfs_dir):
    """The journal flushes its payloads as they land (fdatasync on the flusher's thread),
    not all at the commit: where the disk keeps writes in a cache until a flush (a virtual
    disk, a loop file), the commit's fsync would otherwise pay for the whole stream at once.
    Seen from the device: flush requests complete with no sync and no commit asked for."""
    lay, j = _fresh_journal(xfs_dir / "pool", 8 * MiB)
    before = _flushes(xfs_dir)
    for i in range(48):                        # 3 MiB of payload in 64 KiB records
        d = os.urandom(BS)
        j.append(frames.RecordHeader(0, frames.CODEC_RAW, i * BS, BS, frames.payload_checksum(d)), d)
    deadline = time.monotonic() + 10
    while _flushes(xfs_dir) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _flushes(xfs_dir) > before
    j.close()


def test_a_failed_payload_write_fails_the_journal_at_its_next_write_or_sync(xfs_mod):
    """The writer thread's error (here EBADF: the staging fd closed under it, as a disk
    error would surface) reaches the receiving thread; nothing after it is written."""
    lay, j = _fresh_journal(xfs_mod / "journal-err", 2 * MiB)
    d = os.urandom(BS)
    j.append(frames.RecordHeader(0, frames.CODEC_RAW, 0, BS, frames.payload_checksum(d)), d)
    j.sync()
    os.close(j._data())                         # the next payload write fails
    j.append(frames.RecordHeader(0, frames.CODEC_RAW, BS, BS, frames.payload_checksum(d)), d)
    with pytest.raises(OSError):
        j.sync()
    j._data_fd = None                           # already closed above
    j.close()
    k = Journal(lay, "v")
    assert k.load() and k.scan() == 1           # the failed record is not in the journal


def _indexed(j, index, data):
    j.append(frames.RecordHeader(0, frames.CODEC_RAW, index * BS, BS, frames.payload_checksum(data),
                                   index), data)


def test_scan_keeps_every_landed_record_of_interleaved_stripes(xfs_mod):
    """Stripes interleave records in the journal: a record whose payload did not land is
    dropped alone, not the ones journaled after it; the chain fills in as the indices do,
    and equals the chain of the plan order."""
    lay, j = _fresh_journal(xfs_mod / "journal-stripes", 2 * MiB)
    payloads = {i: os.urandom(BS) for i in range(8)}
    for i in (4, 0, 5, 1, 6, 2, 7):               # index 3 never arrived
        _indexed(j, i, payloads[i])
    assert j.chain.count == 3                      # the contiguous prefix 0..2
    j.sync()
    j.close()
    with open(j.data_path, "r+b") as f:            # the payload of index 5 (third written) torn
        f.seek(2 * BS + 10)
        f.write(b"torn")
    k = Journal(lay, "v")
    assert k.load() and k.scan() == 6
    assert sorted(k.durable()) == [0, 1, 2, 4, 6, 7]
    for i in (3, 5):                               # the resume sends only what is missing
        _indexed(k, i, payloads[i])
    _indexed(k, 4, payloads[4])                    # a record sent twice is kept once
    want = frames.ManifestChain()
    for i in range(8):
        want.update(0, False, i * BS, BS, frames.payload_checksum(payloads[i]))
    assert k.index.complete(8) and k.chain.hexdigest() == want.hexdigest()
    k.mark_committed(8, k.chain.hexdigest())
    k.apply()
    img = lay.image("v").read_bytes()
    assert all(img[i * BS:(i + 1) * BS] == payloads[i] for i in range(8))


def test_a_sealed_journal_takes_no_more_appends_from_any_thread(tmp_path):
    """A striped transaction that fails at its master (its channel cut) closes the journal
    while stripe threads may still be appending what their channels carried. seal() fences
    them off first: before it, a stripe's append could restart the journal's writer thread
    as it stopped, and the two writer threads raced for the one stop marker, so close() could
    wait forever and the receiver kept the unit's lock (seen in the connection-cut fault test
    under load)."""
    import threading

    from drsvc.errors import TransactionEnded
    lay, j = _fresh_journal(tmp_path / "pool", 64 * BS)
    data = os.urandom(BS)
    ck = frames.payload_checksum(data)
    started, errors, appended = threading.Event(), [], []

    def stripe(first):
        try:
            for i in range(first, 10_000, 2):
                j.append(frames.RecordHeader(0, frames.CODEC_RAW, (i % 64) * BS, BS, ck, i), data)
                appended.append(i)
                started.set()
        except TransactionEnded as e:
            errors.append(e)
    threads = [threading.Thread(target=stripe, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    started.wait(10)
    j.seal()
    n = len(appended)
    j.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert len(errors) == 2 and "transaction ended" in str(errors[0])
    assert len(appended) <= n + 2          # at most the appends already under way when seal() came
    assert j._writer._thread is None


def _cached(path, offset: int) -> bool:
    """Whether the page at *offset* of *path* is in the page cache (mincore(2) of a mapping,
    which reads nothing: a read that may not wait would start a readahead of its own)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = offset // mmap.PAGESIZE * mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, page)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(1)
            assert libc.mincore(addr, mmap.PAGESIZE, vec) == 0, os.strerror(ctypes.get_errno())
            return bool(vec.raw[0] & 1)
        finally:
            libc.munmap(addr, mmap.PAGESIZE)
    finally:
        os.close(fd)


def test_records_read_ahead_what_they_overwrite_when_the_unit_keeps_points(xfs_mod):
    """A unit with recovery points copies the bytes each commit overwrites into an undo log
    before the apply. The journal asks for those bytes as each record arrives, so the copy
    finds them cached instead of reading them cold after the stream (a small change over a WAN).
    A unit without points reads nothing ahead."""
    import time

    from drsvc.replication.points.index import Index, Point
    size = 256 * BS
    for keeps in (False, True):
        lay = PoolLayout(xfs_mod / f"journal-readahead-{keeps}")
        (lay.root / "images").mkdir(parents=True)
        img = lay.image("v")
        make_image(img, size, [(0, os.urandom(size))])
        fd = os.open(img, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        lay.ensure_unit_dir("v")
        if keeps:
            Index("v", [Point(1, time.time())]).save(lay)
        overwritten, untouched = [3 * BS, 100 * BS + 8192], [200 * BS]
        assert not any(_cached(img, off) for off in overwritten + untouched)
        j = Journal(lay, "v")
        j.create(_tx(size))
        assert j.read_ahead() is keeps
        for i, off in enumerate(overwritten):
            data = os.urandom(4096)
            j.append(frames.RecordHeader(0, frames.CODEC_RAW, off, 4096, frames.payload_checksum(data), i), data)
        deadline = time.monotonic() + 10
        while keeps and not all(_cached(img, off) for off in overwritten) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(_cached(img, off) for off in overwritten) is keeps
        assert not any(_cached(img, off) for off in untouched)
        j.close()
        assert j._readahead is None


@pytest.mark.parametrize("whole", [True, False])
def test_records_read_ahead_the_replica_map_slots_they_replace(xfs_mod, monkeypatch, whole):
    """The apply writes each record's digests into the replica's block map: the journal asks
    for those map pages as records arrive (a map up to WHOLE_MAP bytes whole, at begin), so
    the apply does not fault them in cold after the stream."""
    import time

    from drsvc.replication.common.blockmap import DIGEST, HEADER, BlockMap
    from drsvc.replication.receiver.journal import _Readahead
    if not whole:
        monkeypatch.setattr(_Readahead, "WHOLE_MAP", 0)
    size = 4096 * BS                               # a map of 64 KiB: 16 pages
    lay = PoolLayout(xfs_mod / f"journal-map-readahead-{whole}")
    (lay.root / "images").mkdir(parents=True)
    make_image(lay.image("v"), size)
    lay.replica_maps_dir("v").mkdir(parents=True)
    mp = lay.replica_map("v", "v")
    with BlockMap.create(mp, BS, size) as m:
        m.write(0, os.urandom(4096 * DIGEST))
        m.fsync()
    fd = os.open(mp, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    slot = lambda off: HEADER.size + off // BS * DIGEST     # noqa: E731
    written, untouched = [300 * BS, 3000 * BS], [2000 * BS]
    assert not any(_cached(mp, slot(off)) for off in written + untouched)
    j = Journal(lay, "v")
    j.create(_tx(size))
    j.read_ahead()
    for i, off in enumerate(written):
        data = os.urandom(4096)
        j.append(frames.RecordHeader(0, frames.CODEC_RAW, off, 4096, frames.payload_checksum(data), i), data)
    deadline = time.monotonic() + 10
    while not all(_cached(mp, slot(off)) for off in written) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(_cached(mp, slot(off)) for off in written)
    assert any(_cached(mp, slot(off)) for off in untouched) is whole
    j.close()
