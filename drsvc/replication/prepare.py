"""Prepare one generation: capture every member at one instant, then plan its records.

Into a private ``snap/tmp-<txid>/`` (nothing half-captured stays): the captured
images or overlays (``capture``), a new block map per member, the plan file
(``plan.bin``, one manifest entry per record: ``delta.scan_member``) and
``meta.json``, written last. Each member is diffed against its *base*: the acked
generation's image and block map (delta), or the peer's block map (compare).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .. import store
from ..host.fiemap import fiemap_array
from ..host.reflink import data_ranges
from . import extentplan  # noqa: F401 - numpy loads with the sender, not inside a worker's first sync
from . import plan as planner
from .blockmap import BlockMap, EmptyMap, copy_map
from .capture import Captured, capture
from .cut import Cut
from .delta import PlanWriter, ScanStats, scan_member
from .generation import Prepared
from .layout import PoolLayout
from .snapstore import base_meta
from .state import UnitState

log = logging.getLogger(__name__)


@dataclass
class MemberBase:
    """What one member is diffed against."""
    fresh: bool                  # nothing: every data block is sent
    size: int
    map: BlockMap | EmptyMap
    image: Path | None = None    # the acked base image (a FIEMAP diff needs it)
    map_path: Path | None = None  # the acked base's block map: the new map starts as its copy


class Baseline:
    """The base of every member: the acked generation (delta) or the peer's block maps
    (compare: volume_id -> (exists, size, map path), as ``remote.read_maps`` gives)."""

    def __init__(self, layout: PoolLayout, st: UnitState, mode: str, bs: int, peer_maps: dict | None):
        self.st, self.mode, self.bs = st, mode, bs
        self.peer_maps = peer_maps or {}
        self.dir = layout.snap_dir(st.unit_id, st.generation)
        self.meta = {m["volume_id"]: m for m in base_meta(layout, st.unit_id, st.generation).get("members", [])}

    def overlay_bases(self, members) -> dict[str, Path]:
        """Members whose acked base can take an overlay capture: reflinked, mapped, present."""
        if self.mode != "delta" or self.st.generation <= 0:
            return {}
        return {vol: self.dir / f"{vol}.img" for vol in members
                if vol in self.st.members and self.meta.get(vol, {}).get("reflinked")
                and (self.dir / f"{vol}.img").exists() and (self.dir / f"{vol}.map").exists()}

    def member(self, vol: str) -> MemberBase:
        if self.mode == "compare":
            exists, psize, ppath = self.peer_maps.get(vol, (False, 0, None))
            return MemberBase(not exists, psize if exists else 0,
                              BlockMap.open(ppath) if exists else EmptyMap(self.bs))
        mp, img = self.dir / f"{vol}.map", self.dir / f"{vol}.img"
        if not (self.st.generation > 0 and vol in self.st.members and vol in self.meta
                and mp.exists() and img.exists()):
            return MemberBase(True, 0, EmptyMap(self.bs))
        base_map = BlockMap.open(mp)
        return MemberBase(False, base_map.size, base_map, img, mp)

    def fiemap_diff(self, vol: str, cap: Captured, base: MemberBase) -> bool:
        """Both sides reflinked from one image: shared extents are unchanged blocks."""
        return (not base.fresh and self.mode == "delta" and cap.reflinked
                and self.meta.get(vol, {}).get("reflinked", False))


def prepare(layout: PoolLayout, st: UnitState, members, *, mountpoints, bs: int, txid: str,
            target: int, base_generation: int, mode: str, peer_maps: dict | None = None,
            cut: Cut | None = None, sources: dict | None = None) -> Prepared:
    """Capture and plan one generation into a private directory. cut: the group spans
    storage nodes (``replication.cut``): the capture meets the other nodes frozen.
    sources: capture these files instead of the live images (a CSI snapshot's)."""
    tmp = layout.snap_root(st.unit_id) / f"tmp-{txid}"
    t0 = time.monotonic()
    captured_at = time.time()          # the origin's capture instant (receive records, data age)
    baseline = Baseline(layout, st, mode, bs, peer_maps)
    timings: dict = {}
    meet = (lambda: cut.frozen(st.epoch, st.generation)) if cut is not None else None
    try:
        captured = capture(layout, members, tmp, mountpoints, baseline.overlay_bases(members), block_size=bs,
                           timings=timings, meet=meet, images=sources)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # nothing half-captured stays (a cut not met, a lost image)
        raise
    t_capture = time.monotonic() - t0
    stats = ScanStats()
    pw = PlanWriter(tmp / "plan.bin")
    try:
        planned = [plan_member(idx, captured[vol], baseline, tmp, pw, stats) for idx, vol in enumerate(members)]
    finally:
        pw.close()
    meta = {"txid": txid, "generation": target, "base_generation": base_generation, "mode": mode,
            "members": [m for m, _ in planned], "records": pw.count, "block_size": bs,
            "fiemap": any(f for _, f in planned),
            "scanned": stats.scanned, "changed": stats.changed, "zeroed": stats.zeroed,
            "capture_s": t_capture, "freeze_s": timings.get("freeze_s", 0.0),
            "precopy_s": timings.get("precopy_s", 0.0),
            "round": timings.get("round"), "cut_wait_s": timings.get("cut_wait_s", 0.0),
            "ranges_cloned": sum(c.cloned for c in captured.values()),
            "plan_s": time.monotonic() - t0 - t_capture,
            "created_at": time.time(), "captured_at": timings.get("frozen_at", captured_at), "complete": True,
            "sources": bool(sources)}
    store.write_doc(tmp / "meta.json", meta)
    return Prepared(tmp, meta)


def plan_member(idx: int, cap: Captured, baseline: Baseline, tmp: Path, pw: PlanWriter,
                stats: ScanStats) -> tuple[dict, bool]:
    """Plan one captured member into *pw* and its new block map: (its meta entry, whether
    its changes were found from extent maps)."""
    vol, bs = cap.volume_id, baseline.bs
    fd = os.open(cap.path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        base = baseline.member(vol)
        try:
            new_map, from_base = _new_map(base, tmp / f"{vol}.map", bs, size)
            try:
                if cap.overlay and not base.fresh:
                    ms, fiemapped = cap.scan, True
                else:
                    ms, fiemapped = _find_changes(fd, size, base, bs, baseline.fiemap_diff(vol, cap, base))
                scan_member(idx, fd, size, base.map, new_map, from_base, ms, bs, pw, stats)
                new_map.fsync()
            finally:
                new_map.close()
        finally:
            base.map.close()
    finally:
        os.close(fd)
    return ({"volume_id": vol, "size": size, "base_size": base.size, "fresh": base.fresh,
             "reflinked": cap.reflinked, "overlay": cap.overlay}, fiemapped)


def _new_map(base: MemberBase, path: Path, bs: int, size: int) -> tuple[BlockMap, bool]:
    """The member's new block map: a copy of the acked base's, updated by the scan where
    it has one (True), else a fresh map the scan fills."""
    if base.map_path is None:
        return BlockMap.create(path, bs, size), False
    copy_map(base.map_path, path)
    new_map = BlockMap.open(path, writable=True)
    new_map.resize(size)
    return new_map, True


def _find_changes(fd: int, size: int, base: MemberBase, bs: int, use_fiemap: bool):
    """The ranges to hash and to clear: from the extent maps of the image and its base
    where both are reflinks of one image, else every data range of the image."""
    if use_fiemap and base.image is not None:
        try:
            bfd = os.open(base.image, os.O_RDONLY)
            try:
                return planner.plan_from_extent_arrays(fiemap_array(fd, size), fiemap_array(bfd, base.size),
                                                       size, base.size, bs), True
            finally:
                os.close(bfd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOENT):
                raise
            log.info("FIEMAP unavailable (%s); hashing every block", e)
    return planner.plan_full_scan([(o, o + n) for o, n in data_ranges(fd, size)], size, base.size, bs), False
