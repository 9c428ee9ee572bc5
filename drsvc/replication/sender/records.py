"""Delta I/O: hashing the ranges a plan names, writing plan entries, and reading
records back for the wire with an adaptive codec.

A plan file lists every record of one generation in order, as manifest entries
(member, kind, offset, length, checksum). It is written once, before anything is
sent, so a resumed transfer sends exactly the same records and the sender can
rebuild the manifest chain without re-reading skipped data.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

import xxhash

from ...errors import ReplicationConflict
from ..common.blockmap import DIGEST, digest_blocks
from ..wire.frames import CODEC_RAW, CODEC_ZERO, CODEC_ZSTD, MANIFEST_ENTRY, ManifestChain, encode_record_header
from . import changes as planner

CHUNK = 1 << 20            # data records never exceed one chunk, aligned to the chunk grid
READAHEAD = 16 << 20       # a fresh snapshot's pages are cold: keep the disk busy ahead of the hashing
CLEAR_WINDOW = 64 << 20    # hole ranges are checked against the base map in larger windows
MAX_ZERO_RECORD = 1 << 30


@dataclass
class ScanStats:
    scanned: int = 0
    changed: int = 0
    zeroed: int = 0
    records: int = 0


class PlanWriter:
    """Writes the plan file; with a *feed* (``generation.PlanFeed``) each entry also goes to
    the stream that sends it while the plan is still being written."""

    def __init__(self, path, feed=None):
        self.f = open(path, "wb", buffering=1 << 20)  # noqa: SIM115 - the writer owns it; close() closes it
        self.count = 0
        self.feed = feed

    def add(self, member: int, is_zero: bool, offset: int, length: int, checksum: int) -> None:
        self.f.write(MANIFEST_ENTRY.pack(member, 1 if is_zero else 0, offset, length, checksum))
        self.count += 1
        if self.feed is not None:
            self.feed.put((member, is_zero, offset, length, checksum))

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def read_plan(path):
    """Yield (member, is_zero, offset, length, checksum) from a plan file."""
    size = MANIFEST_ENTRY.size
    with open(path, "rb", buffering=1 << 20) as f:
        while True:
            raw = f.read(size * 4096)
            if not raw:
                return
            for member, z, off, length, ck in MANIFEST_ENTRY.iter_unpack(raw):
                yield member, bool(z), off, length, ck


def scan_member(member: int, fd: int, size: int, base_map, new_map, new_from_base: bool,
                ms: planner.MemberScan, bs: int, out: PlanWriter, stats: ScanStats) -> None:
    """Hash the scan ranges, compare with the base map, record changed runs in the plan
    and the new digests in the new map. Clear ranges become zero records where the
    base held data."""
    scanner = _MemberScanner(member, fd, size, base_map, new_map, new_from_base, bs, out, stats)
    events = sorted([(s, e, 0) for s, e in ms.scan] + [(s, e, 1) for s, e in ms.clear])
    advised = 0   # scan ranges whose reads were queued ahead
    done_scans = 0
    for start, end, is_clear in events:
        if is_clear:
            scanner.clear(start, end)
            continue
        if advised <= done_scans:
            # many small changed ranges: queue the next reads together, the fresh
            # snapshot's pages are cold and the disk serves them in parallel
            for s, e in ms.scan[advised:advised + 512]:
                os.posix_fadvise(fd, s, min(e - s, READAHEAD), os.POSIX_FADV_WILLNEED)
            advised += 512
        done_scans += 1
        scanner.data(start, end)
    scanner.zeros.flush()


class _ZeroRun:
    """The pending zero record, coalesced across windows and ranges (up to MAX_ZERO_RECORD)."""

    __slots__ = ("member", "out", "stats", "off", "len")

    def __init__(self, member: int, out: PlanWriter, stats: ScanStats):
        self.member, self.out, self.stats = member, out, stats
        self.off = self.len = 0

    def add(self, off: int, length: int) -> None:
        if self.len and self.off + self.len == off and self.len + length <= MAX_ZERO_RECORD:
            self.len += length
            return
        self.flush()
        self.off, self.len = off, length

    def flush(self) -> None:
        if self.len:
            self.out.add(self.member, True, self.off, self.len, 0)
            self.stats.zeroed += self.len
            self.stats.records += 1
            self.len = 0


class _MemberScanner:
    """One member's scan: a data range is read, hashed and compared with the base map
    chunk by chunk (:meth:`data`); a range that became a hole is checked against the base
    map in larger windows (:meth:`clear`). Both feed one zero run."""

    def __init__(self, member: int, fd: int, size: int, base_map, new_map, new_from_base: bool, bs: int,
                 out: PlanWriter, stats: ScanStats):
        self.member, self.fd, self.size, self.bs = member, fd, size, bs
        self.base_map, self.new_map, self.new_from_base = base_map, new_map, new_from_base
        self.out, self.stats = out, stats
        self.chunk = max(CHUNK, bs)
        self.mv = memoryview(bytearray(self.chunk))
        self.zeros = _ZeroRun(member, out, stats)

    def clear(self, start: int, end: int) -> None:
        bs, size, add_zero = self.bs, self.size, self.zeros.add
        pos = start
        while pos < end:
            wend = min(end, (pos // CLEAR_WINDOW + 1) * CLEAR_WINDOW)
            first = pos // bs
            nblocks = -(-(wend - pos) // bs)
            runs = planner.nonzero_runs(self.base_map.read(first, nblocks), first)
            if runs and self.new_from_base:
                self.new_map.clear(first, nblocks)
            for b, c in runs:
                off = b * bs
                add_zero(off, min(c * bs, size - off))
            pos = wend

    def data(self, start: int, end: int) -> None:
        digest = digest_blocks
        fd, size, bs, chunk, mv = self.fd, self.size, self.bs, self.chunk, self.mv
        base_map, new_map, new_from_base = self.base_map, self.new_map, self.new_from_base
        member, out, stats, zeros = self.member, self.out, self.stats, self.zeros
        h64 = xxhash.xxh3_64_intdigest
        pos = start
        while pos < end:
            wend = min(end, (pos // chunk + 1) * chunk)
            n = wend - pos
            first = pos // bs
            base_d = base_map.read(first, -(-n // bs))
            if (pos - start) % (READAHEAD // 2) == 0 and pos + n < end:
                os.posix_fadvise(fd, pos + n, min(READAHEAD, end - pos - n), os.POSIX_FADV_WILLNEED)
            got = os.preadv(fd, [mv[:n]], pos)
            if got < n:
                mv[got:n] = bytes(n - got)
            stats.scanned += n
            new_d = digest(mv[:n], bs)
            if new_d != base_d:
                if new_from_base:
                    new_map.write(first, new_d)
                for b, c, z in planner.changed_runs(new_d, base_d, first):
                    off = b * bs
                    length = min(c * bs, size - off)
                    if z:
                        zeros.add(off, length)
                    else:
                        zeros.flush()
                        rel = off - pos
                        out.add(member, False, off, length, h64(mv[rel:rel + length]))
                        stats.changed += length
                        stats.records += 1
            if not new_from_base and new_d != bytes(len(new_d)):
                new_map.write(first, new_d)
            pos = wend


class AdaptiveCodec:
    """zstd level 1 where it pays, raw otherwise.

    A 64 KiB sample of each record is compressed first; a poor ratio sends the
    record raw. After repeated failures the codec stops probing for a while
    (doubling each time), so incompressible data costs next to nothing."""

    SAMPLE = 64 << 10
    GOOD = 0.85   # keep zstd only when it saves at least 15%

    def __init__(self, mode: str = "auto", level: int = 1):
        self.mode = mode
        self.level = level
        self._cctx = None
        self.fails = 0
        self.skip = 0
        self.backoff = 16

    def _ctx(self):
        if self._cctx is None:
            import zstandard
            self._cctx = zstandard.ZstdCompressor(level=self.level)
        return self._cctx

    def encode(self, data) -> tuple[int, object]:
        if self.mode == "off" or len(data) < 1024:
            return CODEC_RAW, data
        if self.mode == "auto":
            if self.skip:
                self.skip -= 1
                return CODEC_RAW, data
            sample = data[:self.SAMPLE]
            if len(self._ctx().compress(sample)) > self.GOOD * len(sample):
                self.fails += 1
                if self.fails >= 4:
                    self.skip = self.backoff
                    self.backoff = min(self.backoff * 2, 4096)
                    self.fails = 0
                return CODEC_RAW, data
            self.fails = 0
            self.backoff = 16
        packed = self._ctx().compress(data)
        if len(packed) > self.GOOD * len(data):
            return CODEC_RAW, data
        return CODEC_ZSTD, packed


def manifest_of(plan_path, upto: int | None = None, only=None) -> ManifestChain:
    """The chain of the plan's first *upto* records, or of the records whose index is in *only*."""
    chain = ManifestChain()
    for i, (member, z, off, length, ck) in enumerate(read_plan(plan_path)):
        if upto is not None and i >= upto:
            break
        if only is None or i in only:
            chain.update(member, z, off, length, ck)
    return chain


PIPELINE_DEPTH = 8        # frames read ahead of the channels (each <= CHUNK): bounded memory


def stream_records(plan_path, fds: list[int], writes, *, compress: str = "auto", skip=0, held=frozenset(),
                   indexed: bool = False, stop: threading.Event | None = None,
                   flush_at: int = 256 << 10, entries=None, moved=None) -> tuple[int, ManifestChain]:
    """Send the plan's records, but the first *skip* and those in *held*, through the
    channels' ``write(bytes)`` callables (*writes*: one, or a list, one per stripe).
    *entries*: the plan's entries as they are planned (a ``PlanFeed``) instead of its file.
    *moved*: with *entries* of an early plan (``capture_feed``), whether a record's range is
    planned again later; such a record whose bytes changed since its plan entry is sent as
    read, under its own checksum (checked once the plan is whole), any other is an error.

    Returns (records sent, manifest chain over all records). A reader thread reads
    the records in plan (offset) order, checks each against the plan's checksum (a
    snapshot that changed underneath is caught, never sent) and queues batches of whole
    records; each channel's writer takes the next batch when it is free (one channel:
    this thread), encodes it with a codec of its own (*compress*: adaptive zstd; with
    its plan index when *indexed*) and sends it. Reading, compressing and sending
    overlap; with several channels the compression runs on as many threads (zstd
    releases the GIL), and the sender never waits on the peer per record.
    Small records are batched into frames of about *flush_at* bytes. *stop* set by
    another thread ends the stream early (what was sent is sent)."""
    writes = [writes] if callable(writes) else list(writes)
    frames: queue.Queue = queue.Queue(maxsize=PIPELINE_DEPTH + len(writes))
    free = _Buffers(PIPELINE_DEPTH + 2 + len(writes))
    halt = _Halt(stop)       # ours to set (the reader's end); *stop* is the caller's
    result = {"sent": 0, "chain": ManifestChain()}
    skipping = _Skip(skip, held)

    def produce():
        try:
            _read_records(read_plan(plan_path) if entries is None else entries, fds, skipping, flush_at,
                          frames, free, halt, result, moved)
        except BaseException as e:   # re-raised by the writer
            frames.put(("error", e))

    reader = threading.Thread(target=produce, name="drsvc-read-records", daemon=True)
    reader.start()
    try:
        enc = _Encoder(compress, indexed, flush_at)
        if len(writes) == 1:
            _write_frames(frames, free, writes[0], halt, enc)
        else:
            _write_striped(frames, free, writes, halt, enc)
    finally:
        halt.set()
        if reader.is_alive() and entries is not None:
            entries.detach()          # a reader waiting for the plan's next entry: nothing more is sent
        while reader.is_alive():      # unblock a reader waiting on a full queue or for a buffer
            try:
                while True:
                    frames.get_nowait()
            except queue.Empty:
                pass
            free.put(bytearray())
            reader.join(0.05)
    return result["sent"], result["chain"]


class _Buffers:
    """The big records' read buffers (CHUNK each), made as the reader first needs them, up
    to *cap*; then it waits for one the writers hand back (``put``). Made up front, every
    stream zeroed them (11 MiB) before its first record, holding the GIL (7 ms in a fresh
    process, which the plan thread of a pipelined sync waited out too), though a sync of
    small records never uses one."""

    def __init__(self, cap: int):
        self.cap, self.made = cap, 0
        self._q: queue.Queue = queue.Queue()

    def get(self) -> bytearray:
        try:
            return self._q.get_nowait()
        except queue.Empty:
            if self.made < self.cap:
                self.made += 1          # the reader thread alone takes buffers
                return bytearray(CHUNK)
        return self._q.get()

    def put(self, buf: bytearray) -> None:
        self._q.put(buf)


class _Halt:
    """An event of our own that also reads as set once the caller's *stop* is."""

    __slots__ = ("own", "stop")

    def __init__(self, stop: threading.Event | None):
        self.own, self.stop = threading.Event(), stop

    def set(self) -> None:
        self.own.set()

    def is_set(self) -> bool:
        return self.own.is_set() or (self.stop is not None and self.stop.is_set())


class _Skip:
    """The records not to send: the first *skip* (a version 3 resume) and the *held* indices."""

    __slots__ = ("skip", "held")

    def __init__(self, skip: int, held):
        self.skip, self.held = skip, held

    def __contains__(self, i: int) -> bool:
        return i < self.skip or i in self.held


class _Encoder:
    """Turns a batch of records into frames and sends them, with a codec of its own."""

    def __init__(self, compress: str, indexed: bool, flush_at: int):
        self.compress, self.indexed, self.flush_at = compress, indexed, flush_at
        self.codec = AdaptiveCodec(compress)      # zstd contexts are not shared between threads

    def copy(self) -> _Encoder:
        return _Encoder(self.compress, self.indexed, self.flush_at)

    def send(self, records, write) -> None:
        codec = self.codec
        out = bytearray()
        for member, z, off, length, ck, index, data in records:
            index = index if self.indexed else None
            if z:
                out += encode_record_header(member, CODEC_ZERO, off, length, 0, 0, index)
                continue
            c, payload = codec.encode(data)
            out += encode_record_header(member, c, off, length, ck, len(payload), index)
            if len(payload) >= self.flush_at:      # a big payload goes out as it is, after its header
                write(bytes(out))
                out.clear()
                write(payload)
            else:
                out += payload
        if out:
            write(bytes(out))


def _write_frames(frames: queue.Queue, free: _Buffers, write, stop: _Halt, enc: _Encoder) -> None:
    """One channel's writer: batches from the queue until the end (or *stop*)."""
    while not stop.is_set():
        try:
            item = frames.get(timeout=0.2)
        except queue.Empty:
            continue
        kind = item[0]
        if kind == "end":
            frames.put(item)           # for the other channels' writers
            return
        if kind == "error":
            frames.put(item)
            raise item[1]
        enc.send(item[1], write)
        if item[2] is not None:
            free.put(item[2])


def _write_striped(frames: queue.Queue, free: _Buffers, writes, stop: _Halt, enc: _Encoder) -> None:
    """A writer thread per channel; the first failure stops them all and is raised."""
    errors: list[BaseException] = []

    def run(write):
        try:
            _write_frames(frames, free, write, stop, enc.copy())
        except BaseException as e:   # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, args=(w,), name=f"drsvc-stripe-send-{i}", daemon=True)
               for i, w in enumerate(writes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class _Batches:
    """Whole records gathered into batches for the channels' writers."""

    def __init__(self, frames: queue.Queue, flush_at: int):
        self.frames, self.flush_at = frames, flush_at
        self.batch: list = []
        self.size = 0

    def add(self, record: tuple, length: int) -> None:
        self.batch.append(record)
        self.size += length
        if self.size >= self.flush_at or len(self.batch) >= 4096:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            self.frames.put(("batch", self.batch, None))
            self.batch, self.size = [], 0


def _read_checked(fd: int, data: memoryview, member: int, off: int, ck: int, changed: list | None) -> int:
    """Read a record's bytes into *data* and check them against the plan's checksum *ck*; with
    *changed* (an early plan's stream), bytes that differ are kept, listed there, and their own
    checksum returned. Returns the checksum the record goes under."""
    length = len(data)
    got = os.preadv(fd, [data], off)
    if got < length:
        data[got:] = bytes(length - got)
    actual = xxhash.xxh3_64_intdigest(data)
    if actual != ck:
        if changed is None:
            raise ReplicationConflict(unit_id="?", reason=f"snapshot changed under the plan at offset {off}")
        changed.append((member, off, length))
    return actual


def _read_records(entries, fds, skipping, flush_at, frames, free, stop, result, moved=None) -> None:
    """The reader: every record not skipped, read and checked, into batches of whole records
    (member, is_zero, offset, length, checksum, index, data): small ones copied together up to
    *flush_at* bytes, a big one alone in a buffer of its own (back to *free* once sent).
    *entries* may pause (``None``: a plan still being written): what is batched goes then.
    *moved*: see ``stream_records``."""
    chain = result["chain"]
    batches = _Batches(frames, flush_at)
    changed: list = []        # (member, offset, length) sent as read: their ranges must be planned again
    i = -1
    for entry in entries:
        if entry is None:
            batches.flush()
            continue
        i += 1
        member, z, off, length, ck = entry
        if i in skipping or z:
            chain.update(member, z, off, length, ck)
            if i in skipping:
                continue
        if stop.is_set():
            return
        result["sent"] += 1
        if z:
            batches.add((member, True, off, length, 0, i, None), 0)
            continue
        big = length >= flush_at
        buf = free.get() if big else bytearray(length)
        if length > len(buf):
            buf = bytearray(length)
        data = memoryview(buf)[:length]
        ck = _read_checked(fds[member], data, member, off, ck, changed if moved is not None else None)
        chain.update(member, z, off, length, ck)
        if big:
            frames.put(("batch", [(member, False, off, length, ck, i, data)], buf))
            continue
        batches.add((member, False, off, length, ck, i, data), length)
    for member, off, length in changed:      # the plan is whole now (its entries ended)
        if not moved(member, off, length):
            raise ReplicationConflict(unit_id="?", reason=f"snapshot changed under the plan at offset {off}")
    batches.flush()
    frames.put(("end",))


__all__ = ["PlanWriter", "read_plan", "scan_member", "AdaptiveCodec", "stream_records",
           "manifest_of", "ScanStats", "DIGEST"]
