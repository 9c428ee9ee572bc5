"""Prepare one generation: capture every member at one instant, then plan its records.

Into a private ``snap/tmp-<txid>/`` (nothing half-captured stays): the captured
images or overlays (``capture``), a new block map per member, the plan file
(``plan.bin``, one manifest entry per record: ``records.scan_member``) and
``meta.json``, written last. Each member is diffed against its *base*: the acked
generation's image and block map (delta), or the peer's block map (compare).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy  # noqa: F401 - numpy loads with the sender, not inside a worker's first sync

from ... import store
from ...errors import CorruptMetadata, ProtocolError
from ...failpoints import failpoint
from ...host.fiemap import fiemap_array
from ...host.freeze import MountsHeld, no_mounts
from ...host.reflink import data_ranges
from ...layout import PoolLayout
from ..common import ranges
from ..common.blockmap import DIGEST, BlockMap, EmptyMap, copy_map
from ..common.unit_state import UnitState
from . import capture_feed
from . import changes as planner
from .base_store import base_meta, mark_intent
from .capture import Captured, capture
from .generation import Planning, Prepared
from .group_rounds import Cut, abandon
from .records import PlanWriter, ScanStats, scan_member

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
    (compare: volume_id -> (exists, size, map path), as ``receiver_client.read_maps`` gives).
    *repair*: block runs (volume -> [[offset, length]]) the peer's verify found differing from
    the base: they are planned as changed whatever the base's map says."""

    def __init__(self, layout: PoolLayout, st: UnitState, mode: str, bs: int, peer_maps: dict | None,
                 repair: dict | None = None):
        self.st, self.mode, self.bs = st, mode, bs
        self.peer_maps = peer_maps or {}
        self.repair = repair_runs(repair) if mode == "delta" else {}
        self.dir = layout.snap_dir(st.unit_id, st.generation)
        self.meta = {m["volume_id"]: m for m in base_meta(layout, st.unit_id, st.generation).get("members", [])}

    def overlay_bases(self, members) -> dict[str, Path]:
        """Members whose acked base can take an overlay capture: reflinked, mapped, present.
        Not one to repair: an overlay holds only what changed, and a repair reads blocks
        that did not (a whole capture, planned from the extent maps, reads them)."""
        if self.mode != "delta" or self.st.generation <= 0:
            return {}
        return {vol: self.dir / f"{vol}.img" for vol in members
                if vol in self.st.members and vol not in self.repair and self.meta.get(vol, {}).get("reflinked")
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
        if self.repair.get(vol):
            return MemberBase(False, base_map.size, RepairedMap(base_map, self.repair[vol]), img, mp)
        return MemberBase(False, base_map.size, base_map, img, mp)

    def changes(self, vol: str, ms: planner.MemberScan, size: int) -> planner.MemberScan:
        """*ms* with the member's repair runs hashed too (and not cleared)."""
        runs = self.repair.get(vol)
        if not runs:
            return ms
        want = ranges.round_out(ranges.from_pairs([(o, o + n) for o, n in runs]), self.bs, size)
        scan = ranges.union(ranges.from_pairs(ms.scan), want)
        return planner.MemberScan(scan=ranges.pairs(scan),
                                  clear=ranges.pairs(ranges.subtract(ranges.from_pairs(ms.clear), scan)))

    def fiemap_diff(self, vol: str, cap: Captured, base: MemberBase) -> bool:
        """Both sides reflinked from one image: shared extents are unchanged blocks."""
        return (not base.fresh and self.mode == "delta" and cap.reflinked
                and self.meta.get(vol, {}).get("reflinked", False))


def repair_runs(repair: dict | None) -> dict[str, list[tuple[int, int]]]:
    """The block runs of a peer's repair request (its status's ``repair``), checked: the
    peer's word is input like any other."""
    runs = (repair or {}).get("runs") or {}
    try:
        out = {str(vol): [(int(o), int(n)) for o, n in rs] for vol, rs in runs.items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise ProtocolError(reason=f"the peer's repair request is malformed: {e}") from None
    if any(o < 0 or n <= 0 for rs in out.values() for o, n in rs):
        raise ProtocolError(reason="the peer's repair request names a run out of range")
    return out


class RepairedMap:
    """A base's block map that reads as unknown over the runs to repair: the plan compares
    its fresh digests with it, so those blocks are sent whatever they hold (zeros too)."""

    UNKNOWN = b"\xff" * 16       # no block's digest (ZERO is all zeros)

    def __init__(self, inner: BlockMap, runs):
        self.inner, self.block_size, self.size = inner, inner.block_size, inner.size
        bs = inner.block_size
        self.blocks = sorted((o // bs, -(-(o + n) // bs)) for o, n in runs)

    def read(self, first: int, count: int) -> bytes:
        got = self.inner.read(first, count)
        hit = [(max(a, first), min(b, first + count)) for a, b in self.blocks if a < first + count and b > first]
        if not hit:
            return got
        out = bytearray(got)
        for a, b in hit:
            out[(a - first) * DIGEST:(b - first) * DIGEST] = self.UNKNOWN * (b - a)
        return bytes(out)

    def close(self) -> None:
        self.inner.close()


def prepare(layout: PoolLayout, st: UnitState, members, *, mounts: MountsHeld = no_mounts, bs: int, txid: str,
            target: int, base_generation: int, mode: str, peer_maps: dict | None = None, repair: dict | None = None,
            cut: Cut | None = None, sources: dict | None = None, pipelined: bool = False,
            wire_rate: float = 0.0, one_channel=None) -> Prepared:
    """Capture and plan one generation into a private directory. cut: the group spans
    storage nodes (``group_rounds``): the capture meets the other nodes frozen.
    sources: capture these files instead of the live images (a CSI snapshot's).
    pipelined: when every member's plan reads its whole image against nothing
    (``_replannable``), record the intent and return once the capture is done, the plan being
    written on a thread (``Prepared.planning``); its entries can be sent as they come, and
    ``meta["estimate"]`` bounds the bytes it will plan. A delta is pipelined too when its
    estimate takes at least PIPELINE_WIRE_S on the wire at *wire_rate* (bytes/s, 0: unknown):
    its plan's cold reads then hide behind the link (``_wire_bound``). Such a delta of overlay
    members whose records will go on one channel (*one_channel*(estimate)) returns before its
    capture ends: its plan follows the pre-copy's clones (``capture_feed``)."""
    tmp = layout.snap_root(st.unit_id) / f"tmp-{txid}"
    t0 = time.monotonic()
    captured_at = time.time()          # the origin's capture instant (receive records, data age)
    baseline = Baseline(layout, st, mode, bs, peer_maps, repair)
    bases = baseline.overlay_bases(members)
    timings: dict = {}
    meet = (lambda: cut.frozen(st.epoch, st.generation)) if cut is not None else None
    head = {"txid": txid, "generation": target, "base_generation": base_generation, "mode": mode,
            "block_size": bs, "captured_at": captured_at, "repair": (repair or {}).get("id") if baseline.repair else None}
    follow = None
    if (pipelined and not baseline.repair and mode == "delta" and cut is None and not sources and members and set(bases) == set(members)
            and _may_follow(wire_rate, one_channel)):
        follow = capture_feed.Follow(lambda est, sizes, dest: _early_intent(layout, st, baseline, members, head, est,
                                                                         sizes, dest, wire_rate, one_channel))
    try:
        if follow is None:
            captured = capture(layout, members, tmp, mounts=mounts, bases=bases, block_size=bs,
                               timings=timings, meet=meet, images=sources)
        else:
            early = _capture_following(follow, lambda: capture(layout, members, tmp, mounts=mounts, bases=bases,
                                                               block_size=bs, timings=timings, early=follow))
            if early is not None:
                return _plan_following(early, follow, baseline, members, timings, t0, st.unit_id)
            captured = follow.captured
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # nothing half-captured stays (a cut not met, a lost image)
        abandon(cut, timings.get("round"))          # a cut met, then the capture failed
        raise
    meta = {**head, "members": [_member_head(captured[vol], baseline) for vol in members],
            "capture_s": time.monotonic() - t0, "freeze_s": timings.get("freeze_s", 0.0),
            "precopy_s": timings.get("precopy_s", 0.0),
            "round": timings.get("round"), "cut_wait_s": timings.get("cut_wait_s", 0.0),
            "ranges_cloned": sum(c.cloned for c in captured.values()),
            "captured_at": timings.get("frozen_at", head["captured_at"]), "sources": bool(sources)}
    meta["estimate"] = sum(_estimate(captured[m["volume_id"]], m) for m in meta["members"])
    try:
        return _planned(layout, st, tmp, meta, [captured[vol] for vol in members], baseline,
                        pipelined=pipelined, wire_rate=wire_rate)
    except BaseException:
        abandon(cut, meta["round"])
        raise


def _planned(layout: PoolLayout, st: UnitState, tmp: Path, meta: dict, caps: list[Captured], baseline: Baseline,
             *, pipelined: bool, wire_rate: float) -> Prepared:
    """A captured generation planned: now, or on a thread with its intent recorded first."""
    replannable = pipelined and _replannable(tmp, {c.volume_id: c for c in caps}, meta["members"], meta["mode"])
    if replannable or (pipelined and meta["mode"] == "delta" and _wire_bound(meta["estimate"], wire_rate)):
        # The intent first (snap/<G+1>, its plan not yet whole): records may leave before the
        # plan is. A sender that dies meanwhile leaves it to the next sync: a whole-image plan
        # is planned again from its captured images (``replan``) and resumed, with what landed
        # kept; a delta's is dropped (its trailer never left, so the peer cannot have
        # committed it) and the next sync captures afresh.
        meta["replan"] = replannable
        store.write_doc(tmp / "meta.json", meta)
        prepared = mark_intent(layout, st.unit_id, Prepared(tmp, meta))
        caps = _whole_captures(prepared.dir, meta["members"]) if replannable else _moved(caps, tmp, prepared.dir)
        prepared.planning = Planning(lambda feed: _plan_all(prepared.dir, meta, caps, baseline, feed),
                                     f"plan-{st.unit_id}")
        return prepared
    _plan_all(tmp, meta, caps, baseline)
    return Prepared(tmp, meta)


def _may_follow(wire_rate: float, one_channel) -> bool:
    """Whether a delta's plan may follow its capture on this link at all: a rate is stated and
    the smallest link-bound delta (PIPELINE_WIRE_S on the wire) goes on one channel (stripes
    only grow with the bytes). A LAN, or a path that stripes, keeps the ordinary capture."""
    return wire_rate > 0 and one_channel is not None and one_channel(int(wire_rate * PIPELINE_WIRE_S))


def _early_intent(layout: PoolLayout, st: UnitState, baseline: Baseline, members, head: dict, estimate: int,
                  sizes: dict, dest: Path, wire_rate: float, one_channel) -> Path | None:
    """(On the capture's thread, every member's first map window planned, nothing cloned yet.)
    Whether records leave now: a link-bound delta (*estimate*: the first windows' bytes,
    extrapolated) of overlay members that goes on one channel. If so, the generation's intent
    is recorded (``snap/<G+1>``, its meta.json not complete: a sender that dies leaves it
    dropped, as any pipelined delta) and the capture goes on there."""
    if set(sizes) != set(members) or not _wire_bound(estimate, wire_rate) or not one_channel(estimate):
        return None
    heads = []
    for vol in members:
        base = baseline.member(vol)
        base.map.close()
        heads.append({"volume_id": vol, "size": sizes[vol], "base_size": base.size, "fresh": False,
                      "reflinked": True, "overlay": True})
    meta = {**head, "members": heads, "round": None, "cut_wait_s": 0.0, "sources": False,
            "estimate": estimate, "replan": False, "early": True}
    store.write_doc(dest / "meta.json", meta)
    return mark_intent(layout, st.unit_id, Prepared(dest, meta)).dir


def _capture_following(follow: capture_feed.Follow, run) -> Path | None:
    """Run the capture on a thread of its own; the intent's directory once records may leave
    (the capture goes on), or None once it ended as an ordinary one (``follow.captured``)."""
    def body():
        try:
            follow.finished(run())
        except BaseException as e:  # noqa: BLE001 - raised to the caller, or to the plan
            follow.finished(error=e)
    threading.Thread(target=body, name="drsvc-capture", daemon=True).start()
    if follow.wait_decided():
        return follow.dir
    follow.wait_done()
    return None


def _plan_following(d: Path, follow: capture_feed.Follow, baseline: Baseline, members, timings: dict, t0: float,
                    unit_id: str) -> Prepared:
    """The generation whose records leave as the capture clones: its plan on a thread."""
    prepared = Prepared(d, store.read_doc(d / "meta.json"))
    meta, moved = prepared.meta, capture_feed.Moved()

    def run(feed):
        part = capture_feed.plan_early(d, list(members), baseline.member,
                                    lambda base, path, size: _new_map(base, path, baseline.bs, size),
                                    follow, moved, baseline.bs, feed)
        captured = follow.wait_done()
        meta.update(part)
        meta.update({"capture_s": timings.get("capture_s", time.monotonic() - t0),
                     "freeze_s": timings.get("freeze_s", 0.0), "precopy_s": timings.get("precopy_s", 0.0),
                     "captured_at": timings.get("frozen_at", meta["captured_at"]),
                     "ranges_cloned": sum(c.cloned for c in captured.values()),
                     "created_at": time.time(), "complete": True})
        store.write_doc(d / "meta.json", meta)

    prepared.planning = Planning(run, f"plan-{unit_id}")
    prepared.moved = moved
    return prepared


def _plan_all(d: Path, meta: dict, caps: list[Captured], baseline: Baseline, feed=None) -> None:
    """Plan every member into *d* (``plan.bin``, the new maps), then write ``meta.json``
    complete; with a *feed*, each entry also goes to the stream as it is planned."""
    t_plan = time.monotonic()
    stats = ScanStats()
    pw = PlanWriter(d / "plan.bin", feed)
    try:
        fiemapped = []
        for idx, cap in enumerate(caps):
            if idx:
                failpoint("sender.mid_plan")     # the records of the members before may be out
            fiemapped.append(plan_member(idx, cap, baseline, d, pw, stats))
    finally:
        pw.close()
    meta.update({"records": pw.count, "fiemap": any(fiemapped), "scanned": stats.scanned,
                 "changed": stats.changed, "zeroed": stats.zeroed,
                 "plan_s": time.monotonic() - t_plan, "created_at": time.time(), "complete": True})
    store.write_doc(d / "meta.json", meta)


def _replannable(tmp: Path, captured: dict[str, Captured], heads: list[dict], mode: str) -> bool:
    """Every member is a whole image captured into the generation's directory and planned
    against nothing (a first copy, or a group whose members are all new): its plan depends
    on those immutable images alone, so planning it again gives the same records. Only such
    plans are pipelined: a delta's scattered records sent while its cold reads go on are
    slower than the delta planned first, where a whole image's sequential records gain."""
    return mode == "delta" and all(
        h["fresh"] and not h["overlay"] and captured[h["volume_id"]].path == tmp / f"{h['volume_id']}.img"
        for h in heads)


# A delta is pipelined when its records take at least this long on the wire at the rate the
# config states: at 100 Mbit/s, 1% of 1 GiB (0.84 s) is; at 1 Gbit/s it (0.08 s) is not, and
# planned first (see _replannable for what pipelining a fast link's delta costs).
PIPELINE_WIRE_S = 0.25


def _wire_bound(estimate: int, rate: float) -> bool:
    """Whether a delta of at most *estimate* bytes is bound by the link, not by its plan's
    reads: its bytes take PIPELINE_WIRE_S or more at *rate* (bytes/s). An unknown rate
    (0: no ``link_rate``, no bandwidth limit) never is: a LAN plans first."""
    return rate > 0 and estimate / rate >= PIPELINE_WIRE_S


def _moved(caps: list[Captured], old: Path, new: Path) -> list[Captured]:
    """The captures of a prepared directory renamed from *old* to *new* (``mark_intent``)."""
    return [dataclasses.replace(c, path=new / c.path.name) if c.path.parent == old else c for c in caps]


def _whole_captures(d: Path, heads: list[dict]) -> list[Captured]:
    return [Captured(h["volume_id"], d / f"{h['volume_id']}.img", h["reflinked"]) for h in heads]


def replan(layout: PoolLayout, st: UnitState) -> Prepared | None:
    """A pending generation whose sender died before its plan was whole (``snap/<G+1>``,
    ``meta.json`` not complete, ``replan``): plan it again from its captured images, so the
    sync resumes it (the same txid, what the peer journaled kept) instead of sending it all
    again. None when there is none, or when it cannot be planned again (then it is dropped:
    its plan was never whole, so the peer cannot have committed it)."""
    d = layout.snap_dir(st.unit_id, st.generation + 1)
    meta = store.read_doc(d / "meta.json")
    if not meta or meta.get("complete"):
        return None
    if not meta.get("replan"):
        # a pipelined delta whose sender stopped mid-plan: the sweep drops it
        log.info("%s: generation %s was not planned whole before its sender stopped; dropped",
                 st.unit_id, meta.get("generation"))
        return None
    baseline = Baseline(layout, st, meta["mode"], meta["block_size"], None)
    heads = meta["members"]
    try:
        if meta.get("base_generation") != st.generation or any(
                not _fresh(baseline, h["volume_id"]) or not (d / f"{h['volume_id']}.img").exists()
                for h in heads):
            raise CorruptMetadata(path=str(d), reason="its base or its captured images changed")
        _plan_all(d, meta, _whole_captures(d, heads), baseline)
    except (OSError, CorruptMetadata) as e:
        log.warning("%s: generation %s cannot be planned again (%s); dropped", st.unit_id,
                    meta.get("generation"), e)
        shutil.rmtree(d, ignore_errors=True)
        return None
    log.info("%s: generation %s planned again after its sender stopped mid-plan", st.unit_id, meta["generation"])
    return Prepared(d, meta)


def _fresh(baseline: Baseline, vol: str) -> bool:
    base = baseline.member(vol)
    base.map.close()
    return base.fresh


def _member_head(cap: Captured, baseline: Baseline) -> dict:
    """A member's entry in meta.json, known once it is captured."""
    base = baseline.member(cap.volume_id)
    base.map.close()
    return {"volume_id": cap.volume_id, "size": os.stat(cap.path).st_size, "base_size": base.size,
            "fresh": base.fresh, "reflinked": cap.reflinked, "overlay": cap.overlay}


def _estimate(cap: Captured, head: dict) -> int:
    """At most the data bytes the plan of this member will name: the ranges an overlay
    capture left to hash, else the image's allocated bytes."""
    if cap.overlay and not head["fresh"] and cap.scan is not None:
        return ranges.total(ranges.from_pairs(cap.scan.scan))
    return min(head["size"], os.stat(cap.path).st_blocks * 512)


def plan_member(idx: int, cap: Captured, baseline: Baseline, tmp: Path, pw: PlanWriter,
                stats: ScanStats) -> bool:
    """Plan one captured member into *pw* and its new block map; True when its changes
    were found from extent maps."""
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
                ms = baseline.changes(vol, ms, size)
                scan_member(idx, fd, size, base.map, new_map, from_base, ms, bs, pw, stats)
                new_map.fsync()
            finally:
                new_map.close()
        finally:
            base.map.close()
    finally:
        os.close(fd)
    return fiemapped


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
