"""The receiver's transaction journal: records are made durable here first, then applied.

    journal/tx.json       the transaction (unit, txid, base -> target, epoch, members,
                          journal_format)
    journal/records.bin   verified records in arrival order. Format 2 (``ENTRY``): a protocol
                          RECORD header, the record's plan index and its payload's position in
                          data.bin. Format 1 (journals of older releases, replayed only): a
                          RECORD header (+ its payload inline, older still), positions implied
    journal/data.bin      the payloads of records flagged FLAG_DATA, each at a 4 KiB-aligned
                          position, so apply can reflink them into the image
    journal/staging/      new images of members that have no base (written in place)
    journal/digests.bin   the block digests of each data record held, for the replica's
                          block maps (``replica_maps``; not fsynced: it counts in its boot only)
    journal/commit.json   the commit marker: once it exists the transaction is applied,
                          by this process or by replay at the next contact
    journal/prepared.json the vote of a two-phase transaction (a volume group spanning
                          storage nodes): complete and durable, applied only when the
                          sender brings the round's decision (``decide``), never replayed

Records of a striped transaction arrive from several channels in any order, each
carrying its plan index; the journal keeps every valid one (``scan`` drops a record whose
payload did not land, not the ones after it) and rebuilds the manifest chain in plan order
as the indices fill in (``chain``: the chain of the contiguous prefix 0..n-1).

Large payloads are written once: a payload goes to data.bin, and apply remaps those
blocks into the image with FICLONERANGE (metadata only). Apply copies them instead
where the pool cannot reflink, a range is not block aligned (an image's unaligned
tail), or a range is under 64 KiB (a copy from the page cache is cheaper than a
reflink's transaction, and makes no extent).
Applying is idempotent (absolute clones and writes, punches, truncates and renames),
so a replay after a crash at any point converges on the target generation.
"""
from __future__ import annotations

import collections
import errno
import os
import struct
import threading
import time
from pathlib import Path

from ... import store
from ...errors import StreamCorrupt, TransactionEnded
from ...failpoints import failpoint
from ...host.reflink import UNSUPPORTED, clone_file_range, start_writeback
from ...layout import PoolLayout, check_id
from ..common.blockmap import DIGEST, HEADER, punch_hole
from ..common.replica_maps import JournalDigests, ReplicaMaps
from ..common.unit_state import find_state
from ..wire import frames
from ..wire.frames import CODEC_RAW, CODEC_ZERO, RECORD, ManifestChain, RecordHeader
from . import commit_points

FORMAT = 2
# member u16 | codec u8 | flags u8 | offset u64 | length u32 | checksum u64 | index u32 | data pos u64
ENTRY = struct.Struct(">HBBQIQIQ")
FLAG_DIRECT = 0x1   # payload was written straight into a staging image
FLAG_DATA = 0x2     # payload is in data.bin at the running aligned position
ALIGN = 4096
_BUF = 1 << 20
# Apply's copies into the images start their writeback every this many bytes, so the
# images' fsync at the end of the apply finds less left to write (on a disk that writes as
# it goes; one that holds writes until a flush pays at the flush: see _Flusher).
WRITEBACK_EVERY = 32 << 20


class _Writeback:
    """Counts bytes written to fds and starts their writeback every WRITEBACK_EVERY."""

    def __init__(self):
        self.pending: dict[int, int] = {}

    def wrote(self, fd: int, n: int) -> None:
        got = self.pending.get(fd, 0) + n
        if got >= WRITEBACK_EVERY:
            start_writeback(fd)
            got = 0
        self.pending[fd] = got


class _Flusher:
    """Makes what the writer wrote durable while the rest of the stream still arrives:
    fdatasync of each fd that gathered FLUSH_EVERY bytes, on a thread of its own, back to
    back while there is more. The commit's fsync then finds only the last of it to make
    durable. Writeback alone (sync_file_range) does not do that where the disk caches
    writes until a flush (a virtual disk in writeback mode, a loop file): there the cost
    is paid at the flush, in proportion to what was written since the last one.

    A failed fdatasync is kept and raised by :meth:`quiesce` (its caller's drain): the
    kernel reports a writeback error once per open file, so the commit's own fsync on
    the same fd could miss it."""

    FLUSH_EVERY = 1 << 20

    def __init__(self):
        self._cv = threading.Condition()
        self._dirty: dict[int, int] = {}
        self._busy = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def wrote(self, fd: int, n: int) -> None:
        with self._cv:
            got = self._dirty[fd] = self._dirty.get(fd, 0) + n
            if got < self.FLUSH_EVERY:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drsvc-journal-flusher", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _next(self) -> int | None:
        """(holding the lock) The fd to flush next, or None once this thread is stopped."""
        while True:
            if self._thread is not threading.current_thread():
                return None
            fd = max(self._dirty, key=self._dirty.__getitem__, default=None)
            if fd is not None and self._dirty[fd] >= self.FLUSH_EVERY and self.error is None:
                self._dirty[fd] = 0
                self._busy = True
                return fd
            self._cv.wait()

    def _run(self) -> None:
        while True:
            with self._cv:
                fd = self._next()
            if fd is None:
                return
            try:
                os.fdatasync(fd)
            except BaseException as e:  # noqa: BLE001 - raised by quiesce, in the caller's thread
                with self._cv:
                    self.error = self.error or e
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def quiesce(self) -> None:
        """Start no more flushes of what was written so far (the caller's fsync covers it),
        wait for one under way, and raise the first that failed."""
        with self._cv:
            self._dirty.clear()
            while self._busy:
                self._cv.wait()
            if self.error is not None:
                raise self.error

    def stop(self) -> None:
        """End the thread (after a flush under way): the fds may be closed after this."""
        with self._cv:
            th, self._thread = self._thread, None
            self._cv.notify_all()
        if th is not None:
            th.join()
        with self._cv:
            self._dirty.clear()


class _Writer:
    """Writes payloads on a thread of its own, so the receiver reads and checks the next
    frame while the disk takes this one (pwrite and fallocate release the
    GIL). At most LIMIT bytes wait. A failed write is raised at the next write or drain;
    writes after it are dropped. A receiver killed with writes still queued loses only
    their records: scan() cuts the journal at the first record whose payload is missing
    (its checksum fails), and the sender resumes from there."""

    LIMIT = 8 << 20

    def __init__(self):
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._pending = 0            # bytes queued or being written
        self._ops = 0                # operations queued or being written
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._flusher = _Flusher()

    def _submit(self, op: tuple, nbytes: int) -> None:
        with self._cv:
            while self._pending >= self.LIMIT and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise self._error
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drsvc-journal-writer", daemon=True)
                self._thread.start()
            self._q.append((op, nbytes))
            self._pending += nbytes
            self._ops += 1
            self._cv.notify_all()

    def write(self, fd: int, data, offset: int) -> None:
        self._submit((fd, data, offset), len(data))

    def punch(self, fd: int, offset: int, length: int) -> None:
        self._submit((fd, None, offset, length), 0)

    def _wait_idle(self) -> None:
        """(holding the lock) Until every queued write is done, or one failed."""
        while self._ops and self._error is None:
            self._cv.wait()

    def drain(self) -> None:
        """Wait for every queued write and any flush under way; raise the first that failed."""
        with self._cv:
            self._wait_idle()
            if self._error is not None:
                raise self._error
        self._flusher.quiesce()

    def stop(self) -> None:
        """Drain (errors are kept for the next drain) and end the thread."""
        with self._cv:
            self._wait_idle()
            th, self._thread = self._thread, None
            if th is not None:
                self._q.append((None, 0))
                self._cv.notify_all()
        if th is not None:
            th.join()
        self._flusher.stop()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                op, nbytes = self._q.popleft()
            if op is None:
                return
            try:
                if self._error is None:
                    if op[1] is None:
                        punch_hole(op[0], op[2], op[3])
                    else:
                        fd, data, offset = op
                        os.pwrite(fd, data, offset)
                        self._flusher.wrote(fd, len(data))
            except BaseException as e:  # noqa: BLE001 - handed to the receiving thread
                with self._cv:
                    self._error = e
            with self._cv:
                self._pending -= nbytes
                self._ops -= 1
                self._cv.notify_all()


def _aligned(pos: int) -> int:
    return -(-pos // ALIGN) * ALIGN


class _Cloner:
    """Copies data.bin ranges into an image: by reflink while the pool allows it, for
    ranges of at least CLONE_MIN. A reflink is a filesystem transaction (tens of µs and
    an extent each); a small range, just written and still in the page cache, costs
    less to copy, and leaves the image with fewer extents for the next capture to map."""

    CLONE_MIN = 64 << 10

    def __init__(self):
        self.reflink = True
        self.cloned = self.copied = 0

    def copy(self, src: int, src_pos: int, dst: int, dst_pos: int, length: int, wb) -> None:
        if self.reflink and length >= self.CLONE_MIN and not (src_pos | dst_pos | length) % ALIGN:
            try:
                clone_file_range(src, src_pos, dst, dst_pos, length)
                self.cloned += length
                return
            except OSError as e:
                if e.errno in UNSUPPORTED:
                    self.reflink = False
                elif e.errno != errno.EINVAL:
                    raise
        os.pwrite(dst, os.pread(src, length, src_pos), dst_pos)
        wb.wrote(dst, length)
        self.copied += length


class _Readahead:
    """Asks the kernel for what the commit will read, so that it finds it in the page cache:
    the replica's bytes each arriving record overwrites (the recovery points' undo copy,
    ``commit_points.before_apply``, when *images*), and the slots of the replica's block maps
    that the record's digests replace (``replica_maps``; a map of up to WHOLE_MAP bytes is
    asked for whole, at once). The reads run while the rest of the stream arrives, not
    after it. A thread of its own issues the requests (starting a cold read can block),
    and nothing waits for it: what it has not asked for by the commit is read then.
    Members without an image here (fresh ones) are skipped."""

    WHOLE_MAP = 16 << 20

    def __init__(self, layout: PoolLayout, unit_id: str, members, *, images: bool, block_size: int):
        self.fds: dict[int, int] = {}        # member -> its image (images)
        self.maps: dict[int, int] = {}       # member -> its replica map, asked for by record
        self.bs = block_size
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._open: list[int] = []
        for i, m in enumerate(members):
            if m["fresh"]:
                continue
            if images and (fd := self._fd(layout.image(m["volume_id"]))) is not None:
                self.fds[i] = fd
            if (fd := self._fd(layout.replica_map(unit_id, m["volume_id"]))) is not None:
                size = os.fstat(fd).st_size
                if size <= self.WHOLE_MAP:
                    self._ask(fd, 0, size)
                else:
                    self.maps[i] = fd

    def _fd(self, path) -> int | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        self._open.append(fd)
        return fd

    def want(self, member: int, offset: int, length: int) -> None:
        if (fd := self.fds.get(member)) is not None:
            self._ask(fd, offset, length)
        if (fd := self.maps.get(member)) is not None:
            self._ask(fd, HEADER.size + offset // self.bs * DIGEST, -(-length // self.bs) * DIGEST)

    def _ask(self, fd: int, offset: int, length: int) -> None:
        with self._cv:
            self._q.append((fd, offset, length))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drsvc-journal-readahead", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                fd, offset, length = self._q.popleft()
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Drop what is not asked for yet, and close the images once the thread is out."""
        with self._cv:
            self._stopped = True
            self._q.clear()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        for fd in self._open:
            os.close(fd)
        self._open.clear()
        self.fds.clear()
        self.maps.clear()


class _Index:
    """The plan indices a journal holds, and the manifest chain of their contiguous prefix.

    ``entries`` maps index -> manifest entry; the chain advances as the prefix fills in, so a
    stream in plan order costs one chain step per record, and a striped one the
    same in all (a record waits in ``entries`` until those before it arrived)."""

    __slots__ = ("entries", "chain")

    def __init__(self):
        self.entries: dict[int, tuple] = {}
        self.chain = ManifestChain()

    def add(self, index: int, entry: tuple) -> bool:
        """Record an index; False if it was already there (a record sent twice: same content)."""
        if index in self.entries:
            return False
        self.entries[index] = entry
        chain, entries = self.chain, self.entries
        while chain.count in entries:
            chain.update(*entries[chain.count])
        return True

    @property
    def contiguous(self) -> int:
        return self.chain.count

    def complete(self, count: int) -> bool:
        """Exactly the indices 0..count-1 (the chain then covers them all, in plan order)."""
        return self.chain.count == count == len(self.entries)


class Journal:
    def __init__(self, layout: PoolLayout, unit_id: str):
        self.layout = layout
        self.unit_id = unit_id
        self.dir = layout.journal_dir(unit_id)
        self.tx: dict = {}
        self._records = None
        self._data_fd: int | None = None
        self._data_pos = 0
        self._staging_fds: dict[int, int] = {}
        self._writer = _Writer()
        self._unflushed = 0     # payload bytes journaled since the record headers last left our buffer
        self._lock = threading.Lock()   # stripes append from threads of their own
        self._sealed = False            # the transaction ended: no appends, from any thread
        self._readahead: _Readahead | None = None
        self.index = _Index()
        self.maps_s = 0.0
        self._maps: ReplicaMaps | None = None     # applied, the maps still to follow (follow_maps)
        self.digests = JournalDigests(layout.journal_digests(unit_id))

    @property
    def chain(self) -> ManifestChain:
        """The manifest chain of the records 0..n-1 held (n = chain.count)."""
        return self.index.chain

    def durable(self) -> list[int]:
        """The plan indices held (after scan: the ones that survived)."""
        return list(self.index.entries)

    # -- paths
    @property
    def records_path(self) -> Path:
        return self.dir / "records.bin"

    @property
    def data_path(self) -> Path:
        return self.dir / "data.bin"

    @property
    def commit_path(self) -> Path:
        return self.dir / "commit.json"

    def staging_path(self, volume_id: str) -> Path:
        return self.dir / "staging" / f"{check_id(volume_id, 'volume id')}.img"

    # -- lifecycle
    def exists(self) -> bool:
        return (self.dir / "tx.json").exists()

    def load(self) -> bool:
        doc = store.read_doc(self.dir / "tx.json")
        if doc is None:
            return False
        self.tx = doc
        for m in doc["members"]:
            check_id(m["volume_id"], "volume id")
        return True

    @property
    def format(self) -> int:
        return int(self.tx.get("journal_format") or 1)

    def committed(self) -> bool:
        doc = store.read_doc(self.commit_path)
        return bool(doc) and doc.get("txid") == self.tx.get("txid")

    @property
    def prepared_path(self) -> Path:
        return self.dir / "prepared.json"

    def prepared(self) -> bool:
        """Voted: every record is durable, the decision is the sender's (two-phase only)."""
        doc = store.read_doc(self.prepared_path)
        return bool(doc) and doc.get("txid") == self.tx.get("txid")

    def create(self, tx: dict) -> None:
        """Start a fresh journal for *tx* (any previous uncommitted one is dropped)."""
        self.discard()
        tx = dict(tx, journal_format=FORMAT)
        (self.dir / "staging").mkdir(parents=True)
        for m in tx["members"]:
            if m["fresh"]:
                fd = os.open(self.staging_path(m["volume_id"]), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.ftruncate(fd, m["size"])
                finally:
                    os.close(fd)
        for path in (self.records_path, self.data_path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        self.digests.reset()
        store.write_doc(self.dir / "tx.json", tx)   # last: tx.json marks the journal complete
        store.fsync_dir(self.dir.parent)
        self.tx = tx
        self.index = _Index()
        self._data_pos = 0

    def discard(self) -> None:
        self.close(keep=False)
        if self.dir.exists():
            # tx.json first, so a crash mid-removal leaves no journal that looks valid
            store.remove(self.dir / "tx.json")
            store.remove_tree(self.dir)
            store.fsync_dir(self.dir.parent)

    def seal(self) -> None:
        """The transaction ended (it failed): every later append raises TransactionEnded.
        Returns once no append is under way, so a stripe's thread still reading its channel
        cannot queue a write while (or after) the journal closes."""
        with self._lock:
            self._sealed = True

    def read_ahead(self) -> bool:
        """Read ahead what the commit reads (``_Readahead``): the replica's bytes under each
        record as it arrives when the unit keeps recovery points, and the replica's block
        maps. Returns whether the replica's bytes are read ahead. Not those for a durable ack
        (``ack``): its commit reads them after the answer, and read during the stream they
        would take the disk from the journal's own writes, which the answer waits for."""
        if self._readahead is None and self.tx:
            after_answer = self.tx.get("ack") == "durable" and not self.tx.get("demote")
            images = not after_answer and commit_points.keeps_undo(self.layout, self.unit_id)
            with self._lock:
                self._readahead = _Readahead(self.layout, self.unit_id, self.tx["members"], images=images,
                                             block_size=self.tx["block_size"])
        return bool(self._readahead.fds)

    def close(self, keep: bool = True) -> None:
        """Close every file. With *keep* false the files are about to be removed: what is still
        buffered is dropped, so a full filesystem refusing its flush does not stop the removal
        that frees it."""
        self._writer.stop()          # before the fds it writes to are closed
        with self._lock:
            if self._readahead is not None:
                self._readahead.close()
                self._readahead = None
        if self._records is not None:
            records, self._records = self._records, None
            store.close_file(records, keep)
        if self._data_fd is not None:
            os.close(self._data_fd)
            self._data_fd = None
        for fd in self._staging_fds.values():
            os.close(fd)
        self._staging_fds.clear()
        self.digests.close(keep)

    # -- records
    def _staging_fd(self, member: int) -> int:
        fd = self._staging_fds.get(member)
        if fd is None:
            fd = os.open(self.staging_path(self.tx["members"][member]["volume_id"]), os.O_RDWR)
            self._staging_fds[member] = fd
        return fd

    def _data(self) -> int:
        if self._data_fd is None:
            self._data_fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o600)
        return self._data_fd

    def _landed(self, member: int, codec: int, flags: int, offset: int, length: int, checksum: int,
                pos: int) -> bytes | None:
        """A journaled record's payload when it is all there (b"" for a zero record), else None."""
        if codec == CODEC_ZERO:
            return b""
        fd = self._staging_fd(member) if flags & FLAG_DIRECT else self._data()
        data = os.pread(fd, length, offset if flags & FLAG_DIRECT else pos)
        return data if len(data) == length and frames.payload_checksum(data) == checksum else None

    def scan(self) -> int:
        """Verify the journaled records, keep every one whose payload landed, and rebuild
        the index and chain. A torn tail of records.bin is cut; a record whose payload is
        missing or corrupt is dropped alone (striped records interleave: the ones after it
        may be whole). Returns how many records are held. A journal of an older release
        (format 1) is not resumed: it holds nothing to keep (0)."""
        self.close()
        self.index = _Index()
        self._data_pos = 0
        if self.format != FORMAT:
            return 0
        members, bs = self.tx["members"], self.tx["block_size"]
        keep = bytearray()
        self.digests.reset()          # rebuilt from the payloads that landed
        with open(self.records_path, "rb") as f:
            raw = f.read()
        for e in ENTRY.iter_unpack(memoryview(raw)[:len(raw) - len(raw) % ENTRY.size]):
            member, codec, flags, offset, length, checksum, index, pos = e
            if member >= len(members) or codec not in (CODEC_RAW, CODEC_ZERO):
                continue
            data = self._landed(member, codec, flags, offset, length, checksum, pos)
            if data is None:
                continue
            if self.index.add(index, (member, codec == CODEC_ZERO, offset, length, checksum)):
                keep += ENTRY.pack(*e)
                if codec != CODEC_ZERO:
                    self.digests.add(member, offset, bs, JournalDigests.digest(offset, bs, data))
                if flags & FLAG_DATA:
                    self._data_pos = max(self._data_pos, _aligned(pos + length))
        with open(self.records_path, "r+b") as f:
            f.write(keep)
            f.truncate(len(keep))
            os.fsync(f.fileno())
        os.ftruncate(self._data(), self._data_pos)
        os.fsync(self._data())
        return len(self.index.entries)

    def append(self, hdr: RecordHeader, data) -> None:
        """Journal one verified record (data is the decoded payload, None for zeros). A record
        without an index (a version 3 stream, in plan order) takes the next one. Safe to call
        from several threads; a record whose index is already held is dropped (same content)."""
        m = self.tx["members"][hdr.member]
        end = hdr.offset + hdr.length
        if end > m["size"]:
            raise StreamCorrupt(reason=f"record [{hdr.offset}, {end}) beyond image size {m['size']}")
        bs = self.tx["block_size"]
        digests = None if data is None else JournalDigests.digest(hdr.offset, bs, data)  # outside the lock
        with self._lock:
            if self._sealed:
                raise TransactionEnded(unit_id=self.unit_id)
            index = hdr.index if hdr.index >= 0 else len(self.index.entries)
            if not self.index.add(index, (hdr.member, data is None, hdr.offset, hdr.length, hdr.checksum)):
                return
            flags, pos = self._place(hdr, m, data)
            if data is not None:
                self.digests.add(hdr.member, hdr.offset, bs, digests)
            if self._readahead is not None:
                self._readahead.want(hdr.member, hdr.offset, hdr.length)
            if self._records is None:
                self._records = open(self.records_path, "ab", buffering=_BUF)  # noqa: SIM115 - closed by close()
            codec = CODEC_ZERO if data is None else CODEC_RAW
            self._records.write(ENTRY.pack(hdr.member, codec, flags, hdr.offset, hdr.length, hdr.checksum,
                                           index, pos))
            # the payloads go straight to the kernel; hand it the headers too about every _BUF of
            # payload, or a killed receiver loses its whole index and the next attempt cannot resume
            self._unflushed += hdr.length
            if self._unflushed >= _BUF:
                self._records.flush()
                self._unflushed = 0

    def _place(self, hdr: RecordHeader, m: dict, data) -> tuple[int, int]:
        """Queue the payload's write; returns (flags, data.bin position)."""
        if m["fresh"]:
            fd = self._staging_fd(hdr.member)
            if data is None:
                self._writer.punch(fd, hdr.offset, hdr.length)
            else:
                self._writer.write(fd, data, hdr.offset)
            return FLAG_DIRECT, 0
        if data is None:
            return 0, 0
        pos = self._data_pos
        self._writer.write(self._data(), data, pos)
        self._data_pos = _aligned(pos + hdr.length)
        return FLAG_DATA, pos

    def sync(self) -> None:
        self._writer.drain()
        with self._lock:
            if self._records is not None:
                self._records.flush()
                os.fsync(self._records.fileno())
        if self._data_fd is not None:
            os.fsync(self._data_fd)
        for fd in self._staging_fds.values():
            os.fsync(fd)
        self.digests.flush()      # to the kernel: it counts in this boot only (replica_maps)

    def mark_committed(self, count: int, manifest: str) -> None:
        self.sync()
        store.write_doc(self.commit_path, {"txid": self.tx["txid"], "records": count, "manifest": manifest})

    def mark_prepared(self, count: int, manifest: str) -> None:
        self.sync()
        store.write_doc(self.prepared_path, {"txid": self.tx["txid"], "records": count, "manifest": manifest,
                                             "round": self.tx.get("round")})

    # -- apply
    def apply(self, early: dict | None = None) -> _Cloner:
        """Apply a committed journal to the pool's images; safe to repeat. *early*: the undo
        copies made as the records arrived (``undo_copy``), for the recovery points. The
        replica's block maps follow in :meth:`follow_maps` (a commit answers between the two)."""
        self.close()
        commit_points.before_apply(self.layout, self.tx, self.spans, early)   # recovery points: keep what it overwrites
        t = time.monotonic()
        maps = ReplicaMaps(self.layout, self.unit_id)
        follow = maps.begin_apply(self.tx, find_state(self.layout.root, self.unit_id))
        self.maps_s = time.monotonic() - t
        self._maps = maps if follow else None
        members = self.tx["members"]
        fds: dict[int, int] = {}
        cloner = _Cloner()
        try:
            self._open_images(members, fds)
            self._apply_records(fds, cloner)
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
            self.close()
        self._install_staged(members)
        return cloner

    def follow_maps(self) -> None:
        """The replica's block maps take the applied records' digests (``replica_maps``). Only an
        optimisation: left undone (a crash after :meth:`apply`), the maps stay unused, as
        ``begin_apply`` left them."""
        maps, self._maps = self._maps, None
        if maps is None:
            return
        t = time.monotonic()
        maps.apply(self.tx, self.digests.path, ((m, c == CODEC_ZERO, o, n) for m, c, _f, o, n, _p, _i in self._entries()))
        self.maps_s += time.monotonic() - t

    def apply_all(self) -> _Cloner:
        """:meth:`apply`, then :meth:`follow_maps` (a replay, a round's decision)."""
        applied = self.apply()
        self.follow_maps()
        return applied

    def _open_images(self, members, fds: dict[int, int]) -> None:
        """The images of members with a base, at the transaction's size, into *fds*."""
        for i, m in enumerate(members):
            if m["fresh"]:
                continue
            fd = os.open(self.layout.image(m["volume_id"]), os.O_RDWR)
            fds[i] = fd
            if os.fstat(fd).st_size != m["size"]:
                os.ftruncate(fd, m["size"])   # growth is part of the transaction

    def _apply_records(self, fds: dict[int, int], cloner: _Cloner) -> None:
        """Every journaled record into its image (fresh members' are in staging already)."""
        wb = _Writeback()
        for member, codec, flags, offset, length, pos, inline in self._entries():
            if flags & FLAG_DIRECT:
                continue
            if codec == CODEC_ZERO:
                punch_hole(fds[member], offset, length)
            elif flags & FLAG_DATA:
                cloner.copy(self._data(), pos, fds[member], offset, length, wb)
                failpoint("receiver.mid_apply")   # the image now holds a mix
            else:
                os.pwrite(fds[member], inline, offset)
                wb.wrote(fds[member], length)

    def spans(self):
        """(member index, offset, length) of each journaled record (what the apply writes)."""
        for member, _codec, _flags, offset, length, _at, _inline in self._entries():
            yield member, offset, length

    def _entries(self):
        """(member, codec, flags, offset, length, data.bin position, inline payload) of each
        journaled record, in either format."""
        with open(self.records_path, "rb", buffering=_BUF) as f:
            if self.format == FORMAT:
                while len(raw := f.read(ENTRY.size)) == ENTRY.size:
                    member, codec, flags, offset, length, _ck, _index, pos = ENTRY.unpack(raw)
                    yield member, codec, flags, offset, length, pos, None
                return
            pos = 0      # format 1: positions follow from the order
            while len(raw := f.read(RECORD.size)) == RECORD.size:
                member, codec, flags, offset, length, _ck = RECORD.unpack(raw)
                inline = None
                if flags & FLAG_DATA:
                    at, pos = pos, _aligned(pos + length)
                else:
                    at = 0
                    if codec != CODEC_ZERO and not flags & FLAG_DIRECT:
                        inline = f.read(length)
                yield member, codec, flags, offset, length, at, inline

    def _install_staged(self, members) -> None:
        """Fresh members' staging images become the pool's images (renamed, durable)."""
        self.layout.images.mkdir(parents=True, exist_ok=True)
        for m in members:
            if not m["fresh"]:
                continue
            staged = self.staging_path(m["volume_id"])
            if staged.exists():   # absent when a previous replay already renamed it
                store.fsync_file(staged)
                os.replace(staged, self.layout.image(m["volume_id"]))
        store.fsync_dir(self.layout.images)
