"""Capture: the content of every member of a unit at one instant.

Two ways, chosen per member:

* **full**: FICLONE of the whole image into ``<vol>.img`` (first sync of a
  member, compare mode, a pool without reflink). Its cost grows with the image's
  extent count: 1-3.5 s for an aged 1 GiB image on XFS.
* **overlay**: FIEMAP of the live image, diffed against the acked base snapshot
  (vectorized: identical extents drop out first), and FICLONERANGE of only the
  ranges whose physical mapping differs into a sparse ``<vol>.delta``. Ranges
  are block aligned; ``<vol>.ranges`` (cloned) and ``<vol>.clear`` (whole blocks
  that became holes) say how to roll the base forward once the peer commits
  (``roll_forward``). Its cost is one FIEMAP of the live image plus the change.

An overlay capture runs in two passes, so the frozen window follows the writes
made during the capture, not the whole change. Before it, each mounted
filesystem is synced (syncfs, unfrozen), so the data it held dirty is in the
images. The **pre-copy**, before the freeze, maps the live image and clones
every range that differs from the base. Those ranges then share their blocks
with the delta file, so a later write to any of them moves its mapping (copy on
write), as a write to a block still shared with the base does. Inside the
freeze, when the image's mtime has not moved since the pre-copy's map, nothing
was written and nothing is done; otherwise a second FIEMAP, diffed against the
pre-copy's, names exactly the ranges written since, and only they are cloned
again. The generation's ranges and holes are planned from the last map against
the base, as a single pass would; the range files are written after the thaw.

All members are captured inside one freeze of every mountpoint (freeze all,
capture all, thaw all). Without a mountpoint to freeze, an overlay capture is
only kept when the image's mtime shows no write landed between its second FIEMAP
and its last clone; otherwise that member is captured full (one atomic FICLONE).
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import math
import os
import struct
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import xxhash

from ... import store
from ...errors import ImageResized, VolumeNotFound
from ...host.fiemap import EXTENT_DTYPE, FIEMAP_EXTENT_LAST, fiemap_array, fiemap_batches
from ...host.freeze import MountsHeld, frozen, no_mounts, write_back
from ...host.reflink import clone_file, clone_range
from ..common import ranges
from ..common.blockmap import punch_hole
from . import changes as planner

log = logging.getLogger(__name__)
_NO_FIEMAP = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL)


@dataclass
class Captured:
    volume_id: str
    path: Path                       # the file records are read from
    reflinked: bool
    overlay: bool = False
    scan: planner.MemberScan | None = None   # overlay: ranges to hash / to clear
    cloned: int = 0                  # overlay: ranges cloned (FICLONERANGE calls)
    # overlay with a pre-copy: what moved between the pre-copy's map and the capture
    # (None: nothing; a MemberScan: those ranges; WHOLE: the image, cloned again whole)
    since: object = None


WHOLE = "whole"


class Early(Protocol):
    """Lets records leave while the pre-copy still maps and clones (``capture_feed``).
    Called on the capture's thread: ``premapped`` once every member's first map window is
    planned (with the bytes the pre-copy will likely clone, extrapolated, and each member's
    size), before any clone; it returns the directory to capture into from then on (the
    generation's intent), or None for an ordinary capture. Then, member by member, ``window``
    for each map window before its clones, ``cloned`` as they advance, ``mapped`` at its end."""

    def premapped(self, estimate: int, sizes: dict, dest: Path) -> Path | None: ...

    def window(self, vol: str, w: MapWindow) -> None: ...

    def cloned(self, vol: str, upto: int) -> None: ...

    def mapped(self, vol: str, pre: Precopy) -> None: ...


def _ranges_file(path: Path, intervals) -> None:
    import numpy as np
    a = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)   # the file holds native int64 pairs
    with open(path, "wb") as f:
        f.write(a.tobytes())
        f.flush()
        os.fsync(f.fileno())


def read_ranges(path: Path) -> list[tuple[int, int]]:
    a = array("q")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    return list(zip(a[0::2], a[1::2], strict=True))


def _round_out(intervals, bs: int, limit: int) -> list[tuple[int, int]]:
    """The ranges widened to whole blocks of *bs* (a 10% change has ~25,000 ranges)."""
    return ranges.pairs(ranges.round_out(ranges.from_pairs(intervals), bs, limit))


EXTENTS_MAGIC = b"DREXTNT1"
_EXT_HEADER = struct.Struct("<8sQQ")     # magic, image size, xxh3-64 of the extent bytes


def extents_path(image: Path) -> Path:
    """The cached extent map kept beside a generation's image (``<vol>.extents``)."""
    return image.with_suffix(".extents")


def save_extents(path: Path, extents, size: int) -> None:
    """Keep an overlay capture's FIEMAP of the live image: once the base is rolled
    forward it is that generation's extent map (cloned ranges now share the live
    image's blocks; the rest already did), so the next capture need not map the
    base again. Checksummed: a torn file is ignored, never trusted."""
    raw = extents.tobytes()
    with open(path, "wb") as f:
        f.write(_EXT_HEADER.pack(EXTENTS_MAGIC, size, xxhash.xxh3_64_intdigest(raw)) + raw)


def overlay_counts(overlay_dir: Path, vol: str) -> tuple[int, int | None]:
    """(ranges cloned, extents of the captured image) of an overlay member, from the sizes
    of its ``.ranges`` and ``.extents`` files (None: no extent map kept)."""
    import numpy as np
    cloned = os.stat(overlay_dir / f"{vol}.ranges").st_size // 16
    try:
        n = os.stat(overlay_dir / f"{vol}.extents").st_size - _EXT_HEADER.size
    except FileNotFoundError:
        return cloned, None
    return cloned, max(0, n) // np.dtype(EXTENT_DTYPE).itemsize


def load_extents(path: Path, size: int):
    """The cached extent map of an image of *size* bytes, or None (absent, torn, other size)."""
    import numpy as np
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < _EXT_HEADER.size:
        return None
    magic, cached_size, digest = _EXT_HEADER.unpack_from(data)
    raw = memoryview(data)[_EXT_HEADER.size:]
    dt = np.dtype(EXTENT_DTYPE)
    if (magic != EXTENTS_MAGIC or cached_size != size or len(raw) % dt.itemsize
            or xxhash.xxh3_64_intdigest(raw) != digest):
        return None
    return np.frombuffer(raw, dtype=dt).copy()


def _base_extents(base: Path):
    fd = os.open(base, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        cached = load_extents(extents_path(base), size)
        return (fiemap_array(fd, size) if cached is None else cached), size
    finally:
        os.close(fd)


def _coarse_now_ns() -> int:
    return time.clock_gettime_ns(getattr(time, "CLOCK_REALTIME_COARSE", 5))   # Linux: 5


class _Sources:
    """A layout whose member images are other files where named (a CSI snapshot's)."""

    def __init__(self, layout, images: dict):
        self.layout, self.images = layout, images

    def image(self, vol: str) -> Path:
        return Path(self.images[vol]) if vol in self.images else self.layout.image(vol)


def capture(layout, members, dest: Path, *, mounts: MountsHeld = no_mounts, bases: dict | None = None,
            block_size: int = 4096, timings: dict | None = None, meet=None,
            images: dict | None = None, early: Early | None = None) -> dict[str, Captured]:
    """Capture *members* into *dest*. mounts: holds the members' mounted filesystems
    mounted while the capture writes them back and freezes them, and yields their
    mountpoints (``NodeService.mounts_held``). bases: volume id -> acked base image (overlay
    eligible) or None (full). timings gets freeze_s (the frozen window). meet: called
    frozen, before any clone; returns once the other nodes of a spanning group are
    frozen too (timings gets its return value as ``round`` and its wait as ``cut_wait_s``).
    images: volume id -> the file to capture instead of the live image (a CSI snapshot
    shipped as a recovery point: drsvc.replication.control.shipped_snapshots). early: records may leave as the
    pre-copy clones (:class:`Early`); the capture then goes on in the directory it names, and
    an image written after its last map is cloned again whole in place (``Captured.since``)."""
    if images:
        layout = _Sources(layout, images)
    dest.mkdir(parents=True)
    base_ext = _map_bases(members, bases or {})
    out: dict[str, Captured] = {}
    checks = {}
    later: list = []                 # range and extent files, written once the freeze is over
    t0 = time.monotonic()
    with mounts() as mountpoints:
        pre, dest, in_place = _precopy_all(layout, dest, base_ext, block_size, mountpoints, early)
        t_pre = time.monotonic()
        with frozen(mountpoints):
            t_frozen, frozen_at = time.monotonic(), time.time()
            if meet is not None and timings is not None:
                timings["round"] = meet()
                timings["cut_wait_s"] = round(time.monotonic() - t_frozen, 4)
            for vol in members:
                out[vol], check = _capture_member(layout.image(vol), dest, vol, base_ext.get(vol), block_size,
                                                  pre.get(vol), later, settle=not mountpoints, in_place=in_place)
                if check is not None:
                    checks[vol] = check
            t_thaw = time.monotonic()
    for write in later:
        write()
    if timings is not None:
        timings["precopy_s"] = round(t_pre - t0, 4)
        timings["frozen_at"] = frozen_at            # the instant the generation holds
        timings["freeze_s"] = round(t_thaw - t_frozen, 4)
        timings["capture_s"] = round(time.monotonic() - t0, 4)
    if not mountpoints:
        _recapture_written(layout, dest, checks, out, base_ext, block_size, in_place=in_place)
    for c in out.values():      # durability after the thaw, so the freeze lasts only the clones
        store.fsync_file(c.path)
    return out


def _map_bases(members, bases: dict) -> dict:
    """The extent maps of the members' base snapshots (they do not change: mapped before
    the freeze); a member whose base cannot be mapped is captured full."""
    base_ext = {}
    for vol in members:
        base = bases.get(vol)
        if base is None:
            continue
        try:
            base_ext[vol] = _base_extents(base)
        except OSError as e:
            if e.errno not in _NO_FIEMAP:
                raise
            log.info("FIEMAP unavailable on %s (%s): full capture", base, e)
    return base_ext


def _precopy_all(layout, dest: Path, base_ext: dict, bs: int, mountpoints, early: Early | None):
    """The pre-copy of every overlay member: the bulk of the clones, before the freeze.
    Returns (pre-copies, the directory the capture goes on in, whether *early* follows)."""
    pre = {}
    if base_ext:
        write_back(mountpoints)      # what the filesystems hold dirty reaches the images unfrozen
    if early is not None and base_ext:
        return _precopy_early(layout, dest, base_ext, bs, early)
    for vol in base_ext:
        try:
            pre[vol] = _premap(layout.image(vol), base_ext[vol], bs)
        except FileNotFoundError:
            raise VolumeNotFound(volume_id=vol) from None
        except OSError as e:
            if e.errno not in _NO_FIEMAP:
                raise
    for vol, p in pre.items():
        _clone_precopy(layout.image(vol), dest, vol, p)
    return pre, dest, False


@dataclass
class _Mapping:
    """One member's pre-copy being mapped window by window (an early capture)."""
    fd: int
    size: int
    mtime_ns: int | None
    fs_block: int
    windows: object              # the rest of ``_map_windows``
    first: MapWindow
    parts: list


def _precopy_early(layout, dest: Path, base_ext: dict, bs: int, early: Early):
    """The pre-copy mapped in windows: every member's first window, then *early* decides;
    if it follows, each window is handed to it and cloned before the next is mapped, so
    records can leave a few milliseconds in; if not, an ordinary pre-copy."""
    maps: dict[str, _Mapping] = {}
    try:
        for vol in base_ext:
            m = _start_mapping(layout.image(vol), vol, base_ext[vol], bs)
            if m is not None:
                maps[vol] = m
        estimate = sum(ranges.total(ranges.from_pairs(m.first.ms.scan)) * m.size // max(m.first.end, 1) for m in maps.values())
        for vol, m in maps.items():        # every overlay exists before a record may be read from it
            _clone_ranges(m.fd, dest / f"{vol}.delta", m.size, [], create=True)
        moved = early.premapped(estimate, {vol: m.size for vol, m in maps.items()}, dest) if maps else None
        pre = {}
        for vol, m in maps.items():
            if moved is not None:
                pre[vol] = _clone_windows(m, itertools.chain([m.first], m.windows), moved, vol, early)
                early.mapped(vol, pre[vol])
            else:
                pre[vol] = _assemble(m, [m.first, *m.windows])
                _clone_ranges(m.fd, dest / f"{vol}.delta", m.size, pre[vol].clone, create=False)
        return pre, moved or dest, moved is not None
    finally:
        for m in maps.values():
            os.close(m.fd)


def _start_mapping(src: Path, vol: str, base, bs: int) -> _Mapping | None:
    """Open a member's image and map its first window (None: FIEMAP does not work there)."""
    try:
        fd = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        raise VolumeNotFound(volume_id=vol) from None
    try:
        settled = _settled(fd, os.fstat(fd))
        st = settled or os.fstat(fd)
        fs_block = max(st.st_blksize, 4096)
        parts: list = []
        windows = _map_windows(fiemap_batches(fd, st.st_size, first=EARLY_FIRST, batch=EARLY_BATCH),
                               st.st_size, base, bs, fs_block, parts)
        first = next(windows)
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_FIEMAP:
            raise
        return None
    except BaseException:
        os.close(fd)
        raise
    return _Mapping(fd, st.st_size, st.st_mtime_ns if settled else None, fs_block, windows, first, parts)


def _assemble(m: _Mapping, windows: list[MapWindow]) -> Precopy:
    import numpy as np
    ms = planner.MemberScan(scan=[r for w in windows for r in w.ms.scan],
                            clear=[r for w in windows for r in w.ms.clear])
    clone = [r for w in windows for r in w.clone]
    extents = np.concatenate(m.parts) if m.parts else np.zeros(0, dtype=np.dtype(EXTENT_DTYPE))
    return Precopy(extents, ms, m.size, len(clone), m.mtime_ns, clone)


def _clone_windows(m: _Mapping, windows, dest: Path, vol: str, early: Early) -> Precopy:
    """Each window handed to *early*, then cloned into ``<vol>.delta``; the next window is
    mapped only then (``windows`` is lazy past the first)."""
    done: list[MapWindow] = []
    dfd = os.open(dest / f"{vol}.delta", os.O_RDWR)
    try:
        early.cloned(vol, 0)
        for w in windows:
            early.window(vol, w)
            for n, (s, e) in enumerate(w.clone, 1):
                clone_range(m.fd, dfd, s, e - s)
                if n % PROGRESS_EVERY == 0:
                    early.cloned(vol, e)
            early.cloned(vol, w.end)
            done.append(w)
    finally:
        os.close(dfd)
    return _assemble(m, done)


def _capture_member(src: Path, dest: Path, vol: str, base, bs: int, pre, later: list, *, settle: bool,
                    in_place: bool = False):
    """(Frozen) an overlay against *base* where there is one and FIEMAP works, else the
    whole image. Returns the capture and, for an overlay, its (mtime, size) check."""
    if base is not None:
        try:
            return _overlay(src, dest, vol, base, bs, pre=pre, later=later, settle=settle, in_place=in_place)
        except FileNotFoundError:
            raise VolumeNotFound(volume_id=vol) from None
        except OSError as e:
            if e.errno not in _NO_FIEMAP:
                raise
            if in_place and pre is not None:
                return _whole_in_place(src, dest, vol, base, bs, later), None
    return _full(src, dest, vol), None


def _recapture_written(layout, dest: Path, checks: dict, out: dict, base_ext: dict, bs: int, *,
                       in_place: bool = False) -> None:
    """Nothing was frozen: an overlay member written since its last FIEMAP is captured whole
    (in place, into its overlay, when records may have left from it: ``Early``)."""
    for vol, (mtime_ns, size) in checks.items():
        st = os.stat(layout.image(vol))
        if st.st_mtime_ns != mtime_ns or st.st_size != size:
            log.info("%s changed during its overlay capture: capturing it whole", vol)
            if in_place:
                later: list = []
                out[vol] = _whole_in_place(layout.image(vol), dest, vol, base_ext[vol], bs, later)
                for write in later:
                    write()
                continue
            for suffix in (".delta", ".ranges", ".clear", ".extents"):
                (dest / f"{vol}{suffix}").unlink(missing_ok=True)
            out[vol] = _full(layout.image(vol), dest, vol)


def _full(src: Path, dest: Path, vol: str) -> Captured:
    try:
        reflinked = clone_file(src, dest / f"{vol}.img", fsync=False)
    except FileNotFoundError:
        raise VolumeNotFound(volume_id=vol) from None
    return Captured(vol, dest / f"{vol}.img", reflinked)


def _whole_in_place(src: Path, dest: Path, vol: str, base, bs: int, later: list) -> Captured:
    """The whole image cloned over its overlay ``<vol>.delta`` in one FICLONERANGE (atomic:
    writes to the image wait for it), planned against the base from the overlay's own map.
    Records may have left from the overlay (``Early``): it stays the file they are read from."""
    base_extents, base_size = base
    path = dest / f"{vol}.delta"
    fd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != os.fstat(dfd).st_size:
                raise ImageResized(volume_id=vol)
            clone_range(fd, dfd, 0, size)
            extents = fiemap_array(dfd, size)
        finally:
            os.close(dfd)
    finally:
        os.close(fd)
    fs_block = max(os.stat(path).st_blksize, 4096)
    ms = planner.plan_from_extent_arrays(extents, base_extents, size, base_size, bs)
    later.append(lambda: (_ranges_file(dest / f"{vol}.ranges", _round_out(ms.scan, fs_block, size)),
                          _ranges_file(dest / f"{vol}.clear", ms.clear),
                          (dest / f"{vol}.extents").unlink(missing_ok=True)))
    return Captured(vol, path, True, overlay=True, scan=ms, cloned=1, since=WHOLE)


@dataclass
class Precopy:
    extents: object              # the live image's FIEMAP the pre-copy cloned from
    ms: planner.MemberScan       # and its plan against the base
    size: int
    cloned: int
    mtime_ns: int | None         # the image's settled mtime before that FIEMAP (None: busy)
    clone: list = dataclasses.field(default_factory=list)   # the ranges to clone (block aligned)


def _settled(fd: int, st):
    """Wait until the coarse clock has passed the image's mtime, so any later write moves
    it (a write in the tick of the last one would not); None when it keeps moving."""
    for _ in range(3):
        if st.st_mtime_ns < _coarse_now_ns():
            return st
        time.sleep(0.005)
        st = os.fstat(fd)
    return None


def _premap(src: Path, base, bs: int) -> Precopy:
    """The pre-copy's map: the live image's FIEMAP and its plan against the base, unfrozen."""
    base_extents, base_size = base
    fd = os.open(src, os.O_RDONLY)
    try:
        settled = _settled(fd, os.fstat(fd))
        st = settled or os.fstat(fd)
        size = st.st_size
        extents = fiemap_array(fd, size)
        ms = planner.plan_from_extent_arrays(extents, base_extents, size, base_size, bs)
        clone = _round_out(ms.scan, max(st.st_blksize, 4096), size)
    finally:
        os.close(fd)
    return Precopy(extents, ms, size, len(clone), st.st_mtime_ns if settled else None, clone)


EARLY_FIRST = 1024      # extents in an early capture's first map window: the first records wait for it
EARLY_BATCH = 8192      # and in each window after it


@dataclass
class MapWindow:
    """One window [start, end) of an early capture's map (``_map_windows``)."""
    start: int
    end: int
    ms: planner.MemberScan       # its ranges to hash and to clear, against the base
    clone: list                  # its ranges to clone (filesystem blocks, inside the window)


def _clip(intervals, lo: int, hi: int) -> list[tuple[int, int]]:
    return ranges.pairs(ranges.clip(ranges.from_pairs(intervals), lo, hi))


def _map_windows(batches, size: int, base, bs: int, fs_block: int, parts: list):
    """The pre-copy's map in windows, as FIEMAP gives the live image's extents (*batches*:
    ``fiemap_batches``; each batch is appended to *parts*). A window ends at a multiple of the
    block sizes at or before its batch's last extent, and is planned from every extent of the
    image and of the base that overlaps it, then clipped to it: the same ranges as one plan of
    the whole map (``tests/unit/test_capture_windows.py``)."""
    import numpy as np
    base_extents, base_size = base
    bstart = base_extents["logical"].astype(np.int64)
    bend = bstart + base_extents["length"].astype(np.int64)
    align = math.lcm(bs, fs_block)
    w0, carry = 0, base_extents[:0]
    for part in batches:
        parts.append(part)
        sel = np.concatenate([carry, part])
        last = bool(part["flags"][-1] & FIEMAP_EXTENT_LAST)
        reach = int(part["logical"][-1] + part["length"][-1])
        w1 = size if last else min(size, reach // align * align)
        if w1 > w0:
            yield _window(sel, base_extents[(bstart < w1) & (bend > w0)], w0, w1, size, base_size, bs, fs_block)
            w0 = w1
        ends = sel["logical"].astype(np.int64) + sel["length"].astype(np.int64)
        carry = sel[ends > w0]
    if w0 < size:
        yield _window(carry, base_extents[bend > w0], w0, size, size, base_size, bs, fs_block)


def _window(new, base, w0: int, w1: int, size: int, base_size: int, bs: int, fs_block: int) -> MapWindow:
    whole = planner.plan_from_extent_arrays(new, base, size, base_size, bs)
    ms = planner.MemberScan(scan=_clip(whole.scan, w0, w1), clear=_clip(whole.clear, w0, w1))
    return MapWindow(w0, w1, ms, _clip(_round_out(ms.scan, fs_block, size), w0, w1) if ms.scan else [])


PROGRESS_EVERY = 128     # ranges cloned between two progress calls (``Early.cloned``)


def _clone_precopy(src: Path, dest: Path, vol: str, pre: Precopy) -> None:
    """Clone every range of the pre-copy's map into ``<vol>.delta``, unfrozen."""
    fd = os.open(src, os.O_RDONLY)
    try:
        _clone_ranges(fd, dest / f"{vol}.delta", pre.size, pre.clone, create=True)
    finally:
        os.close(fd)


def _clone_ranges(fd: int, path: Path, size: int, ranges, *, create: bool) -> None:
    """FICLONERANGE *ranges* of the image open as *fd* into the sparse file *path*."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    dfd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(dfd, size)
        for s, e in ranges:
            clone_range(fd, dfd, s, e - s)
    finally:
        os.close(dfd)


def _overlay(src: Path, dest: Path, vol: str, base, bs: int, pre: Precopy | None = None, *, later: list,
             settle: bool = True, in_place: bool = False):
    """The frozen pass: clone into ``<vol>.delta`` what the pre-copy (if any) has not; the
    range and extent files are appended to *later* (written after the thaw). in_place:
    records may have left from the overlay already (``Early``): it is never made anew."""
    base_extents, base_size = base
    fd = os.open(src, os.O_RDONLY)
    since = None
    try:
        # Unfrozen (settle): the mtime check after the thaw must see any write that lands
        # after our FIEMAP. Frozen, no write can land and there is no mtime check: no wait.
        st = _settled(fd, os.fstat(fd)) if settle else os.fstat(fd)
        if st is None:
            raise OSError(errno.EINVAL, "image is being written: capture it whole")
        size = st.st_size
        fs_block = max(st.st_blksize, 4096)
        path = dest / f"{vol}.delta"
        if pre is not None and pre.size == size and pre.mtime_ns == st.st_mtime_ns:
            new_extents, ms, clone = pre.extents, pre.ms, []      # not written since the pre-copy
        else:
            new_extents = fiemap_array(fd, size)
            ms = planner.plan_from_extent_arrays(new_extents, base_extents, size, base_size, bs)
            if pre is not None and pre.size == size:
                # only what was written since the pre-copy: its mapping moved
                since = planner.plan_from_extent_arrays(new_extents, pre.extents, size, size, bs)
                clone = _round_out(since.scan, fs_block, size)
                if not since.scan and not since.clear:
                    since = None
            elif in_place and pre is not None:
                raise ImageResized(volume_id=vol)
            else:
                path.unlink(missing_ok=True)        # resized since the pre-copy: one pass, frozen
                pre = None
                clone = _round_out(ms.scan, fs_block, size)
        _clone_ranges(fd, path, size, clone, create=not path.exists())
    finally:
        os.close(fd)
    cloned = len(clone) + (pre.cloned if pre is not None else 0)
    later.append(lambda: (_ranges_file(dest / f"{vol}.ranges", _round_out(ms.scan, fs_block, size)),
                          _ranges_file(dest / f"{vol}.clear", ms.clear),
                          save_extents(dest / f"{vol}.extents", new_extents, size)))
    return (Captured(vol, path, True, overlay=True, scan=ms, cloned=cloned, since=since),
            (st.st_mtime_ns, size))


def roll_forward(base_img: Path, overlay_dir: Path, vol: str, size: int) -> None:
    """Make *base_img* the overlay's generation in place: size, cloned ranges, holes.

    Repeat-safe: every action sets a range to a fixed content, so a run cut short
    and run again ends the same."""
    fd = os.open(base_img, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        dfd = os.open(overlay_dir / f"{vol}.delta", os.O_RDONLY)
        try:
            for s, e in read_ranges(overlay_dir / f"{vol}.ranges"):
                clone_range(dfd, fd, s, e - s)
        finally:
            os.close(dfd)
        for s, e in read_ranges(overlay_dir / f"{vol}.clear"):
            punch_hole(fd, s, e - s)
        os.fsync(fd)
    finally:
        os.close(fd)
