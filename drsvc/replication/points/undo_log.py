"""The bytes of recovery points: range sets, undo logs, and images built from them.

A point that is not the live replica keeps, per member, an *undo log*: the member's
bytes at the point's generation wherever a newer generation changed them. The log is
append-only and packed, like the receiver's journal data: each range's bytes at the next
4 KiB-aligned position, so keeping a generation's overwritten blocks is one sequential
write and one fsync (a sparse file written at the blocks' own offsets made the fsync
pay a random write and an extent per block). Its *map* says where each range went:
(offset, length, position) rows sorted by offset, position -1 for a range that reads
as zeros. Everything a map does not cover reads as the next newer point
(drsvc.replication.points). The live replica keeps being written in place by the
receiver and stays unfragmented.

Ranges of 64 KiB or more, aligned, are shared with FICLONERANGE (metadata only); smaller
ones are copied (a reflink is a transaction of tens of microseconds). Every write sets
a range to a fixed content, so a run cut short and run again ends the same: a log only
grows, and a map names only bytes made durable before it was written.

Given a *sums* path, an append records the digest of every 4 KiB block it adds to the log
(``points.digests``), so a verify can check the log later.

Range sets are ``common.ranges``' int64 (starts, ends) arrays;
maps travel in point metadata as base64 of little-endian int64 triples.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import os
from pathlib import Path

from ...host.reflink import UNSUPPORTED, clone_file_range
from ..common import ranges
from ..common.blockmap import DIGEST, ZERO, digest_blocks, punch_hole
from .digests import SUM_BLOCK, RecordedSums, SumsWriter, read_sums

CLONE_MIN = 64 << 10
ALIGN = 4096
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)


def _np():
    import numpy as np
    return np


# -- maps: (offset, length, position) rows ---------------------------------------------
def no_map():
    np = _np()
    return np.zeros((0, 3), dtype=np.int64)


def encode_map(m) -> str:
    return base64.b64encode(_np().ascontiguousarray(m, dtype="<i8").tobytes()).decode()


def decode_map(text: str | None):
    np = _np()
    if not text:
        return no_map()
    return np.frombuffer(base64.b64decode(text), dtype="<i8").astype(np.int64).reshape(-1, 3)


def merge_maps(a, b):
    """Two maps of disjoint ranges as one, sorted by offset."""
    np = _np()
    m = np.concatenate([a, b]) if len(b) else a
    return m[np.argsort(m[:, 0], kind="stable")] if len(b) else m


def in_log_order(m):
    """The rows by log position. A log filled by several appends (its own undo, then the
    folds of pruned points) interleaves them by offset; read in log order, what lies
    together in the log is one run, shared with one FICLONERANGE (``append``)."""
    return m[m[:, 2].argsort(kind="stable")] if len(m) > 1 else m


def covered(m):
    return ranges.normalize(m[:, 0], m[:, 0] + m[:, 1])


def map_bytes(m) -> int:
    """Bytes a map keeps in its log (zero ranges cost nothing)."""
    return int(m[m[:, 2] >= 0, 1].sum()) if len(m) else 0


def clip(m, want):
    """The rows of map *m* cut to the ranges *want* (positions moved along)."""
    np = _np()
    ws, we = want
    if not len(m) or not len(ws):
        return no_map()
    ms, me = m[:, 0], m[:, 0] + m[:, 1]
    pts = ranges.boundaries(ms, me, ws, we)
    lo, hi = pts[:-1], pts[1:]
    row = np.searchsorted(ms, lo, side="right") - 1
    rc = np.maximum(row, 0)
    in_map = (row >= 0) & (me[rc] > lo)
    w = np.searchsorted(ws, lo, side="right") - 1
    wc = np.maximum(w, 0)
    keep = in_map & (w >= 0) & (we[wc] > lo)
    lo, hi, row = lo[keep], hi[keep], row[keep]
    if not len(lo):
        return no_map()
    head = np.ones(len(lo), dtype=bool)                  # glue pieces of one row that touch
    head[1:] = (row[1:] != row[:-1]) | (lo[1:] != hi[:-1])
    starts = np.flatnonzero(head)
    ends = np.append(starts[1:], len(lo)) - 1
    s, e, r = lo[starts], hi[ends], row[starts]
    pos = m[r, 2]
    return np.stack([s, e - s, np.where(pos >= 0, pos + (s - ms[r]), -1)], axis=1)


# -- what one transaction changes -----------------------------------------------------
def changed_ranges(spans, tx: dict) -> dict:
    """volume id -> the ranges a committed journal changes in that member's image: its
    records (*spans*, (member index, offset, length) each, as ``Journal.spans`` gives them)
    and the growth past the base size. Fresh members are left out: they had no image at
    the base. So are members the transaction leaves as they were: an idle generation's
    commit finds nothing to keep without loading numpy."""
    members = tx["members"]
    starts: dict[int, list] = {i: [] for i, m in enumerate(members) if not m["fresh"]}
    ends: dict[int, list] = {i: [] for i in starts}
    for member, offset, length in spans:
        if member in starts:
            starts[member].append(offset)
            ends[member].append(offset + length)
    out = {}
    for i, s in starts.items():
        m = members[i]
        if m["size"] > m["base_size"]:
            s.append(m["base_size"])
            ends[i].append(m["size"])
        if s:
            out[m["volume_id"]] = ranges.normalize(s, ends[i])
    return out


# -- logs -------------------------------------------------------------------------------
def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _clone(src: int, src_pos: int, dst: int, dst_pos: int, length: int) -> bool:
    """FICLONERANGE; False where the kernel refuses (no reflink here, or not aligned)."""
    try:
        clone_file_range(src, src_pos, dst, dst_pos, length)
        return True
    except OSError as e:
        if e.errno not in UNSUPPORTED and e.errno != errno.EINVAL:
            raise
        return False


def _zero(data) -> bool:
    return data == _ZEROS[:len(data)]


class _Appender:
    """Appends ranges to a log: small ones gathered into large sequential writes."""

    def __init__(self, fd: int, sums: Path | None = None):
        self.fd = fd
        self.end = _aligned(os.fstat(fd).st_size)
        self.buf = bytearray()
        self.buf_at = self.end
        self.data = 0
        self.sums = SumsWriter(sums, self.end) if sums is not None else None
        self.src_sums: Path | None = None      # the digests of the log shared from, when one is
        self._src_recorded: RecordedSums | None = None
        self.known: list[tuple[int, bytes]] = []   # (position in buf, recorded digests) of copied ranges

    def flush(self) -> None:
        if self.buf:
            os.pwrite(self.fd, self.buf, self.buf_at)
            if self.sums is not None:
                self.sums.add(self._digests())
            self.buf = bytearray()
            self.known = []
        self.buf_at = self.end

    def _digests(self) -> bytes:
        """The buffer's block digests: those of the bytes in hand, except where a range was
        copied from a log with recorded digests. Those are taken over, so damage in the source
        is not blessed by hashing it again: a verify of this log still finds it."""
        got = digest_blocks(self.buf, SUM_BLOCK)
        if not self.known:
            return got
        out = bytearray(got)
        for at, d in self.known:
            i = at // SUM_BLOCK * DIGEST
            out[i:i + len(d)] = d
        return bytes(out)

    def _recorded(self, src_pos: int, length: int) -> bytes | None:
        """The source log's recorded digests of the blocks of a copied range (a fold's), or
        None: not from a log with sums, or not at a block of it."""
        if self.sums is None or self.src_sums is None or src_pos % ALIGN:
            return None
        if self._src_recorded is None:
            self._src_recorded = RecordedSums.load(self.src_sums)
        return self._src_recorded.get(src_pos // ALIGN, _aligned(length) // ALIGN)

    def add(self, src: int, src_pos: int, length: int) -> int:
        """Append *length* bytes of *src* at *src_pos*; the log position, or -1 for zeros."""
        if _clonable(src_pos, length) and (at := self.share(src, src_pos, length, length)) is not None:
            return at
        data = os.pread(src, length, src_pos)
        if len(data) < length:
            data += bytes(length - len(data))         # past the source's end: zeros
        known = self._recorded(src_pos, length)
        if _zero(data) and (known is None or known == ZERO * (len(known) // DIGEST)):
            return -1
        if known is not None:
            self.known.append((len(self.buf), known))
        self.buf += data
        self.buf += bytes(_aligned(length) - length)
        if len(self.buf) >= _CHUNK:
            at = self._took(length)
            self.flush()
            return at
        return self._took(length)

    def share(self, src: int, src_pos: int, length: int, data: int, src_sums: Path | None = None) -> int | None:
        """Append *length* bytes of *src* at *src_pos* (a run holding *data* bytes of ranges)
        by one FICLONERANGE: the log position, or None where the kernel refuses. Their
        digests: the source log's recorded ones (*src_sums*, when it covers them), else read."""
        self.flush()
        os.ftruncate(self.fd, self.end + length)
        if not _clone(src, src_pos, self.fd, self.end, length):
            return None
        if self.sums is not None:
            known = read_sums(src_sums or self.src_sums, src_pos // ALIGN, length // ALIGN) \
                if not src_pos % ALIGN else None
            if known is not None:
                self.sums.add(known)
            else:
                self.sums.add_read(src, src_pos, length)
        at = self.end
        self.end += length
        self.buf_at = self.end
        self.data += data
        return at

    def _took(self, length: int) -> int:
        at = self.end
        self.end += _aligned(length)
        self.data += length
        return at


def log_end(m) -> int:
    """Where the bytes a map names end in its log: what lies after is an unfinished copy's."""
    used = m[m[:, 2] >= 0] if len(m) else m
    return int((used[:, 2] + -(-used[:, 1] // ALIGN) * ALIGN).max()) if len(used) else 0


def _runs(pieces):
    """Pieces grouped into runs whose bytes follow each other in one source at 4 KiB-aligned
    positions (a pruned point's log, as it was packed): a run is shared in one FICLONERANGE."""
    run: list = []
    for piece in pieces:
        _off, ln, src, pos = piece
        if run and src is not None and src == run[-1][2] and pos % ALIGN == 0 \
                and pos == run[-1][3] + _aligned(run[-1][1]):
            run.append(piece)
            continue
        if run:
            yield run
        run = [piece]
    if run:
        yield run


def _run_length(run) -> int:
    return run[-1][3] + _aligned(run[-1][1]) - run[0][3]


def _shared(run) -> bool:
    """Whether the run is shared by reflink (where the filesystem can), not read: a run of
    several ranges, or one aligned range, of at least CLONE_MIN."""
    first = run[0]
    if first[2] is None:
        return False
    if len(run) > 1:
        return _run_length(run) >= CLONE_MIN and first[3] % ALIGN == 0
    return _clonable(first[3], first[1])


def _clonable(pos: int, length: int) -> bool:
    """Whether one range is shared, not copied: aligned, and at least CLONE_MIN."""
    return length >= CLONE_MIN and not (pos | length) % ALIGN


def _add_run(w: _Appender, run, rows: list) -> None:
    """One run: shared whole when it is long enough, else range by range."""
    first = run[0]
    if len(run) > 1 and _shared(run):
        base = w.share(first[2], first[3], _run_length(run), sum(p[1] for p in run))
        if base is not None:
            rows.extend((off, ln, base + pos - first[3]) for off, ln, _src, pos in run)
            return
    for off, ln, src, pos in run:
        rows.append((off, ln, -1 if src is None else w.add(src, pos, ln)))


@contextlib.contextmanager
def _appending(log: Path, after, sums: Path | None = None):
    """The log at *log* open for appends (bytes past what *after* names cut off first), made
    durable once the appends are done, with its digests (*sums*) when asked for."""
    fd = os.open(log, os.O_RDWR | os.O_CREAT, 0o600)
    w = None
    try:
        if after is not None and os.fstat(fd).st_size > log_end(after):
            os.ftruncate(fd, log_end(after))
        w = _Appender(fd, sums)
        yield w
        w.flush()
        # XFS keeps blocks past the end of a file appended in turns (speculative preallocation):
        # a truncate to the size gives them back
        os.ftruncate(fd, w.end)
        os.fsync(fd)
        if w.sums is not None:
            w.sums.close()
            w.sums = None
    finally:
        if w is not None and w.sums is not None:
            w.sums.close(durable=False)
        os.close(fd)


def append(log: Path, pieces, *, after=None, sums: Path | None = None) -> tuple:
    """Append the *pieces* ((offset, length, source fd or None for zeros, source position))
    to the log at *log*, durably. *after*: the log's map so far; bytes past what it names
    are cut off first (None: keep the log as it is). *sums*: where the log's block digests
    are recorded (``points.digests``). Returns the pieces' map rows and the data bytes written."""
    np = _np()
    runs = list(_runs(pieces))
    for run in runs:                 # what will be read: the kernel reads it all at once
        if not _shared(run):
            for _off, ln, src, pos in run:
                if src is not None:
                    os.posix_fadvise(src, pos, ln, os.POSIX_FADV_WILLNEED)
    rows: list = []
    with _appending(log, after, sums) as w:
        for run in runs:
            _add_run(w, run, rows)
    return (np.asarray(rows, dtype=np.int64).reshape(-1, 3) if rows else no_map()), w.data


def append_rows(log: Path, src: int, m, *, after=None, sums: Path | None = None,
                src_sums: Path | None = None) -> tuple:
    """``append`` of the ranges map *m* names in the log open as *src* (rows in log order,
    ``in_log_order``; position -1: zeros), with the same log and rows as
    ``append(log, log_pieces(src, m), after=after)``; a shared run takes its digests from
    *src_sums*, the source log's, where they cover it. A fold moves thousands of ranges that
    lie together in the pruned point's log: the runs are found with array operations, and
    only the ranges of runs that are not shared are handled one by one."""
    np = _np()
    if not len(m):
        return append(log, (), after=after, sums=sums)
    off, ln, pos = m[:, 0], m[:, 1], m[:, 2]
    ends = pos + (-(-ln // ALIGN)) * ALIGN
    joins = (pos[1:] >= 0) & (pos[:-1] >= 0) & (pos[1:] % ALIGN == 0) & (pos[1:] == ends[:-1])
    starts = np.concatenate([[0], np.flatnonzero(~joins) + 1])
    stops = np.append(starts[1:], len(m))
    length = ends[stops - 1] - pos[starts]
    shared = np.where(stops - starts > 1, (length >= CLONE_MIN) & (pos[starts] >= 0) & (pos[starts] % ALIGN == 0),
                      (ln[starts] >= CLONE_MIN) & (pos[starts] >= 0) & ((pos[starts] | ln[starts]) % ALIGN == 0))
    for i, j in zip(starts[~shared].tolist(), stops[~shared].tolist(), strict=True):
        for at, n in zip(pos[i:j].tolist(), ln[i:j].tolist(), strict=True):
            if at >= 0:      # what will be read: the kernel reads it all at once
                os.posix_fadvise(src, at, n, os.POSIX_FADV_WILLNEED)
    parts: list = []
    with _appending(log, after, sums) as w:
        w.src_sums = src_sums
        for i, j, whole, n in zip(starts.tolist(), stops.tolist(), shared.tolist(), length.tolist(), strict=True):
            if whole and j - i > 1:
                base = w.share(src, int(pos[i]), n, int(ln[i:j].sum()))
                if base is not None:
                    parts.append(np.stack([off[i:j], ln[i:j], base + pos[i:j] - pos[i]], axis=1))
                    continue
            parts.append(np.asarray([(o, n2, -1 if at < 0 else w.add(src, at, n2))
                                     for o, n2, at in m[i:j].tolist()], dtype=np.int64).reshape(-1, 3))
    return np.concatenate(parts).astype(np.int64, copy=False), w.data


def image_pieces(fd: int, want, size: int):
    """Pieces of *want* ranges of an image open as *fd* (beyond *size*: zeros)."""
    for s, e in zip(want[0].tolist(), want[1].tolist(), strict=True):
        inside = min(e, size)
        if inside > s:
            yield s, inside - s, fd, s
        if e > max(s, inside):
            yield max(s, inside), e - max(s, inside), None, -1


def log_pieces(fd: int, m):
    for off, ln, pos in m.tolist():
        yield off, ln, (fd if pos >= 0 else None), pos


def lay(dst: int, log: Path, m) -> None:
    """Write the map's ranges onto the file open as *dst* (zeros where the map says so);
    the caller fsyncs *dst*. Every aligned range is shared with FICLONERANGE, whatever its
    size: *dst* is a reflink of a newer image, so a copy would be a read of the log and a
    copy-on-write of a shared block, several times the cost of sharing it."""
    if not len(m):
        return
    src = os.open(log, os.O_RDONLY) if (m[:, 2] >= 0).any() else -1
    try:
        for off, ln, pos in m.tolist():
            if pos < 0:
                punch_hole(dst, off, ln)
            elif (off | pos | ln) % ALIGN or not _clone(src, pos, dst, off, ln):
                os.pwrite(dst, os.pread(src, ln, pos), off)
    finally:
        if src >= 0:
            os.close(src)


def allocated(path: Path) -> int:
    """Bytes the file holds on disk (its allocated blocks)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
