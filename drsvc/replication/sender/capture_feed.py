"""Records that leave while the capture still maps and clones: the plan follows the pre-copy.

An overlay capture (``capture``) maps the live image, clones every range that differs from
the base into ``<vol>.delta`` (the pre-copy, unfrozen), then, frozen, clones again what was
written meanwhile. Over a slow link the records wait for none of it here: the pre-copy maps
in windows (one FIEMAP batch each, ``capture._map_windows``); once every member's first
window is planned, the generation's intent is recorded, and the plan reads each range as
soon as its clone is in the overlay, so the stream starts a few milliseconds into the
capture instead of after it (1% of an aged 1 GiB image: a FIEMAP of 15,000-25,000 extents
and 2,600 clones, 0.08-0.10 s).

A range cloned by the pre-copy holds what the image held then. What was written after its
clone is in ``Captured.since`` once the capture ends (the ranges whose mapping moved; or the
whole image, cloned again in place when nothing could be frozen and it kept changing), and
the plan then goes over those ranges a second time, against the new block map (what the
first pass planned), adding records after the first pass's. Records apply in plan order at
the peer, so the later ones win; such a plan is marked ``ordered`` and goes on one channel.
A first-pass record the stream reads after its range was cloned again carries the bytes it
reads, under their own checksum (``Prepared.moved`` says which ranges may), and its plan
entry is rewritten to the overlay's bytes, so a resumed stream of the plan reads what the
plan says.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

from ...failpoints import failpoint
from ..wire.frames import MANIFEST_ENTRY
from .capture import WHOLE, Captured, MapWindow, Precopy
from .changes import MemberScan
from .generation import PlanCancelled, PlanFeed
from .records import PlanWriter, ScanStats, scan_member

WINDOW = 128     # scan ranges planned per wait for their clones (the capture reports every 128)


class Follow:
    """The capture's side (``capture.Early``) and the plan's side of one early capture. The
    capture's thread calls ``premapped`` (where *decide* records the intent or declines), then
    per member ``window``, ``cloned`` and ``mapped``, and at its end ``finished``; the plan
    waits in ``windows``, ``wait_cloned`` and ``wait_done``."""

    def __init__(self, decide):
        self._decide = decide
        self._cv = threading.Condition()
        self.decided = False
        self.dir: Path | None = None        # where the capture goes on (None: an ordinary capture)
        self.sizes: dict[str, int] = {}
        self._windows: dict[str, list[MapWindow]] = {}
        self.pre: dict[str, Precopy] = {}   # members whose pre-copy is mapped and cloned whole
        self.upto: dict[str, int] = {}      # volume id -> offset up to which its overlay holds the pre-copy
        self.captured: dict[str, Captured] | None = None
        self.error: BaseException | None = None
        self.done = False

    # -- the capture's thread
    def premapped(self, estimate: int, sizes: dict, dest: Path) -> Path | None:
        d = self._decide(estimate, sizes, dest)
        with self._cv:
            self.sizes, self.dir, self.decided = dict(sizes), d, True
            self._cv.notify_all()
        return d

    def window(self, vol: str, w: MapWindow) -> None:
        with self._cv:
            self._windows.setdefault(vol, []).append(w)
            self._cv.notify_all()

    def cloned(self, vol: str, upto: int) -> None:
        with self._cv:
            self.upto[vol] = upto
            self._cv.notify_all()

    def mapped(self, vol: str, pre: Precopy) -> None:
        with self._cv:
            self.pre[vol] = pre
            self._cv.notify_all()

    def finished(self, captured: dict | None = None, error: BaseException | None = None) -> None:
        with self._cv:
            self.captured, self.error, self.done, self.decided = captured, error, True, True
            self._cv.notify_all()

    # -- the caller's and the plan's
    def wait_decided(self) -> bool:
        """Until the capture decided (or ended); True when records may leave before it ends."""
        with self._cv:
            self._cv.wait_for(lambda: self.decided)
            return self.dir is not None

    def _wait(self, ready, feed: PlanFeed | None) -> None:
        """(Holding the lock) until *ready*() or the capture's end; raises the capture's
        error, or PlanCancelled once the plan's reader is gone."""
        while not ready() and not self.done:
            if feed is not None and feed.cancelled:
                raise PlanCancelled()
            self._cv.wait(0.05)
        if self.error is not None:
            raise self.error

    def windows(self, vol: str, feed: PlanFeed | None = None):
        """*vol*'s map windows in order, each as soon as the capture mapped it."""
        i = 0
        while True:
            with self._cv:
                self._wait(lambda n=i: len(self._windows.get(vol, ())) > n or vol in self.pre, feed)
                ws = self._windows.get(vol, [])
                if i >= len(ws):
                    return
                w = ws[i]
            i += 1
            yield w

    def wait_cloned(self, vol: str, end: int, feed: PlanFeed | None = None) -> None:
        """Until *vol*'s overlay holds its pre-copy up to *end*."""
        with self._cv:
            self._wait(lambda: self.upto.get(vol, -1) >= end, feed)

    def wait_done(self) -> dict[str, Captured]:
        with self._cv:
            self._cv.wait_for(lambda: self.done)
            if self.error is not None:
                raise self.error
            return self.captured


class Moved:
    """The ranges an early plan went over again, per member index (``Prepared.moved``)."""

    def __init__(self):
        self.ranges: dict[int, tuple[list[int], list[int]]] = {}   # member -> (starts, ends), sorted

    def add(self, member: int, ms: MemberScan) -> None:
        starts: list[int] = []
        ends: list[int] = []
        for s, e in sorted(list(ms.scan) + list(ms.clear)):     # merged: touching or overlapping
            if ends and s <= ends[-1]:
                ends[-1] = max(ends[-1], e)
            else:
                starts.append(s)
                ends.append(e)
        self.ranges[member] = (starts, ends)

    def __call__(self, member: int, offset: int, length: int) -> bool:
        """Whether [offset, offset+length) of *member* is within the ranges planned again."""
        if member not in self.ranges:
            return False
        starts, ends = self.ranges[member]
        i = bisect.bisect_right(starts, offset) - 1
        return i >= 0 and ends[i] >= offset + length


def _windows(ms: MemberScan):
    """The member's plan in windows of WINDOW scan ranges: (offset the clones must reach, the
    window's MemberScan); clear ranges go with the window their start falls in."""
    scan, clear = list(ms.scan), sorted(ms.clear)
    ci = 0
    for i in range(0, max(len(scan), 1), WINDOW):
        part = scan[i:i + WINDOW]
        last = i + WINDOW >= len(scan)
        bound = part[-1][1] if part and not last else None
        cl = []
        while ci < len(clear) and (bound is None or clear[ci][0] < bound):
            cl.append(clear[ci])
            ci += 1
        yield (part[-1][1] if part else 0), MemberScan(scan=part, clear=cl)


def plan_early(d: Path, members: list[str], member_base, new_map_of, follow: Follow, moved: Moved,
               bs: int, feed: PlanFeed) -> dict:
    """Plan the generation in *d* behind the pre-copy's clones, then again over what moved
    (see the module's doc). *member_base*(vol) gives its base (``prepare.MemberBase``),
    *new_map_of*(base, path, size) its new block map. Returns the plan's part of meta.json."""
    t_plan = time.monotonic()
    stats = ScanStats()
    pw = PlanWriter(d / "plan.bin", feed)
    open_: list[tuple] = []
    try:
        for idx, vol in enumerate(members):
            if idx:
                failpoint("sender.mid_plan")
            follow.wait_cloned(vol, 0, feed)      # its overlay exists
            size = follow.sizes[vol]
            fd, base, new_map, from_base = _open_member(d, vol, size, member_base, new_map_of)
            open_.append((fd, base, new_map))
            for w in follow.windows(vol, feed):
                for reach, part in _windows(w.ms):
                    follow.wait_cloned(vol, reach, feed)
                    scan_member(idx, fd, size, base.map, new_map, from_base, part, bs, pw, stats)
        first_pass = pw.count
        _second_pass(members, follow, open_, moved, bs, pw, stats)
        for _fd, _base, new_map in open_:
            new_map.fsync()
    finally:
        pw.close()
        for fd, base, new_map in open_:
            os.close(fd)
            new_map.close()
            base.map.close()
        if not follow.done:
            try:
                follow.wait_done()        # the capture's thread ends before the plan says it did
            except BaseException:  # noqa: BLE001 - the plan's own error, if any, is the one raised
                pass
    if moved.ranges:
        _rewrite_moved(d / "plan.bin", first_pass, [d / f"{vol}.delta" for vol in members], moved)
    return {"records": pw.count, "fiemap": True, "scanned": stats.scanned, "changed": stats.changed,
            "zeroed": stats.zeroed, "plan_s": time.monotonic() - t_plan, "ordered": bool(moved.ranges)}


def _open_member(d: Path, vol: str, size: int, member_base, new_map_of) -> tuple:
    """(overlay fd, base, new block map, whether it starts as the base's) of one member."""
    fd = os.open(d / f"{vol}.delta", os.O_RDONLY)
    try:
        base = member_base(vol)
        try:
            return (fd, base, *new_map_of(base, d / f"{vol}.map", size))
        except BaseException:
            base.map.close()
            raise
    except BaseException:
        os.close(fd)
        raise


def _second_pass(members: list[str], follow: Follow, open_: list, moved: Moved, bs: int, pw: PlanWriter,
                 stats: ScanStats) -> None:
    """Once the capture ended: each member's ranges that moved after their clone, planned
    again against what the first pass planned (its new block map), after the first pass."""
    captured = follow.wait_done()
    for idx, vol in enumerate(members):
        cap = captured[vol]
        if cap.since is None:
            continue
        again = cap.scan if cap.since == WHOLE else cap.since
        fd, _base, new_map = open_[idx]
        scan_member(idx, fd, follow.sizes[vol], new_map, new_map, True, again, bs, pw, stats)
        moved.add(idx, again)


def _rewrite_moved(plan: Path, first_pass: int, files: list[Path], moved: Moved) -> None:
    """The first pass's data entries in ranges planned again: their checksums as the overlay
    holds them now (a resumed stream reads them from there, and checks them)."""
    import xxhash
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        with open(plan, "r+b") as f:
            raw = bytearray(f.read(first_pass * MANIFEST_ENTRY.size))
            for i in range(first_pass):
                member, z, off, length, _ck = MANIFEST_ENTRY.unpack_from(raw, i * MANIFEST_ENTRY.size)
                if z or member not in moved.ranges:
                    continue
                data = os.pread(fds[member], length, off)
                data += bytes(length - len(data))
                MANIFEST_ENTRY.pack_into(raw, i * MANIFEST_ENTRY.size, member, z, off, length,
                                         xxhash.xxh3_64_intdigest(data))
            f.seek(0)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    finally:
        for fd in fds:
            os.close(fd)
