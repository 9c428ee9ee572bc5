"""The sender: steps of one sync. capture -> plan -> stream -> commit -> finalize.

Every step is safe to repeat. The order of side effects makes a retry converge:

1. capture + plan into ``snap/tmp-<txid>/`` (ours alone; swept at the next sync);
2. rename it to ``snap/<target>/``: the intent, "this generation may be on the wire";
3. stream it; the peer journals, commits and applies it;
4. record the result: state.json says generation = target; drop the old base.

A sync that finds ``snap/<target>/`` left by a failed run asks the peer: if the
peer committed that txid the generation is adopted (finalize); if not, it is
resumed (same snapshot, same plan, skipping what the peer already journaled).
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
from ..errors import CorruptMetadata, InvalidParameter, NotPrimary, ReplicationConflict, StaleEpoch
from ..host.fiemap import fiemap_array
from ..host.reflink import clone_file, data_ranges
from . import extentplan  # noqa: F401 - numpy loads with the sender, not inside a worker's first sync
from . import plan as planner
from .capture import capture, roll_forward
from .blockmap import DEFAULT_BLOCK_SIZE, BlockMap, EmptyMap, check_block_size, copy_map
from .delta import AdaptiveCodec, PlanWriter, ScanStats, manifest_of, scan_member, stream_records
from .layout import PoolLayout, check_id
from .driver import drive
from .progress import Progress
from .remote import ApplySession
from .report import SyncReport
from .state import UnitState, find_state, save_state
from .steps import Job

log = logging.getLogger(__name__)
MODES = ("delta", "compare")


@dataclass
class Prepared:
    dir: Path
    meta: dict


def _rmtree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
        store.fsync_dir(path.parent)


def load_pending(layout: PoolLayout, unit_id: str, acked: int) -> Prepared | None:
    d = layout.snap_dir(unit_id, acked + 1)
    meta = store.read_doc(d / "meta.json")
    if meta is None or not meta.get("complete"):
        return None
    return Prepared(d, meta)


def sweep(layout: PoolLayout, unit_id: str, acked: int, pending) -> None:
    """Remove snapshot dirs that are neither the acked base nor the pending generation."""
    recover(layout, unit_id, acked)
    keep = {str(acked)} | ({str(acked + 1)} if pending else set())
    root = layout.snap_root(unit_id)
    if not root.exists():
        return
    for child in root.iterdir():
        if child.name not in keep:
            shutil.rmtree(child, ignore_errors=True)


def member_file(gen_dir: Path, member: dict) -> Path:
    """The file a generation's records are read from: its overlay, or its whole image."""
    vol = member["volume_id"]
    return gen_dir / (f"{vol}.delta" if member.get("overlay") and not (gen_dir / f"{vol}.img").exists()
                      else f"{vol}.img")


def _roll(layout: PoolLayout, unit_id: str, gen_dir: Path, meta: dict) -> None:
    """Give every overlay member of an adopted generation its whole image: the base
    image rolled forward in place, then moved in. Repeat-safe (see recover)."""
    base_dir = layout.snap_dir(unit_id, meta["base_generation"])
    moved = False
    for m in meta["members"]:
        vol = m["volume_id"]
        if not m.get("overlay") or (gen_dir / f"{vol}.img").exists():
            continue
        base_img = base_dir / f"{vol}.img"
        if not base_img.exists():
            raise CorruptMetadata(path=str(gen_dir), reason=f"base image of overlay member {vol} is gone")
        roll_forward(base_img, gen_dir, vol, m["size"])
        os.rename(base_img, gen_dir / f"{vol}.img")
        moved = True
    if moved:
        store.fsync_dir(gen_dir)
        store.fsync_dir(base_dir)
    for m in meta["members"]:
        for suffix in (".delta", ".ranges", ".clear"):
            (gen_dir / f"{m['volume_id']}{suffix}").unlink(missing_ok=True)


def recover(layout: PoolLayout, unit_id: str, acked: int) -> None:
    """Finish an adopt cut short between recording the generation and rolling its base."""
    if acked <= 0:
        return
    d = layout.snap_dir(unit_id, acked)
    meta = store.read_doc(d / "meta.json")
    if meta and any(m.get("overlay") and not (d / f"{m['volume_id']}.img").exists()
                    for m in meta["members"]):
        log.warning("%s: finishing the adopt of generation %d", unit_id, acked)
        _roll(layout, unit_id, d, meta)


def generation_image(layout: PoolLayout, unit_id: str, generation: int, vol: str, scratch: Path) -> Path:
    """A whole image of *vol* at a kept generation (the acked base or the pending one):
    the file itself, or for a pending overlay a reflink of the base rolled forward
    into *scratch*."""
    d = layout.snap_dir(unit_id, generation)
    if (d / f"{vol}.img").exists():
        return d / f"{vol}.img"
    meta = store.read_doc(d / "meta.json") or {}
    m = next(x for x in meta.get("members", []) if x["volume_id"] == vol)
    out = Path(scratch) / f"{vol}.img"
    clone_file(layout.snap_dir(unit_id, meta["base_generation"]) / f"{vol}.img", out, fsync=False)
    roll_forward(out, d, vol, m["size"])
    return out


def _base_meta(layout, unit_id, st: UnitState) -> dict:
    if st.generation <= 0:
        return {}
    return store.read_doc(layout.snap_dir(unit_id, st.generation) / "meta.json") or {}


def _member_scan(fd, size, base_img: Path | None, base_size, bs, use_fiemap: bool):
    if use_fiemap and base_img is not None:
        try:
            bfd = os.open(base_img, os.O_RDONLY)
            try:
                return planner.plan_from_extent_arrays(fiemap_array(fd, size), fiemap_array(bfd, base_size),
                                                       size, base_size, bs), True
            finally:
                os.close(bfd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOENT):
                raise
            log.info("FIEMAP unavailable (%s); hashing every block", e)
    return planner.plan_full_scan([(o, o + n) for o, n in data_ranges(fd, size)], size, base_size, bs), False


def _overlay_bases(layout, st: UnitState, members, mode: str, base_meta: dict) -> dict:
    """Members whose acked base can take an overlay capture: reflinked, mapped, present."""
    if mode != "delta" or st.generation <= 0:
        return {}
    base_dir = layout.snap_dir(st.unit_id, st.generation)
    return {vol: base_dir / f"{vol}.img" for vol in members
            if vol in st.members and base_meta.get(vol, {}).get("reflinked")
            and (base_dir / f"{vol}.img").exists() and (base_dir / f"{vol}.map").exists()}


def prepare(layout: PoolLayout, st: UnitState, members, *, mountpoints, bs: int, txid: str,
            target: int, base_generation: int, mode: str, peer_maps: dict | None = None,
            cut=None, sources: dict | None = None) -> Prepared:
    """Capture and plan one generation into a private directory. cut: the group spans
    storage nodes (``replication.cut``): the capture meets the other nodes frozen.
    sources: capture these files instead of the live images (a CSI snapshot's)."""
    unit_id = st.unit_id
    tmp = layout.snap_root(unit_id) / f"tmp-{txid}"
    t0 = time.monotonic()
    captured_at = time.time()          # the origin's capture instant (receive records, data age)
    base_dir = layout.snap_dir(unit_id, st.generation)
    base_meta = {m["volume_id"]: m for m in _base_meta(layout, unit_id, st).get("members", [])}
    timings: dict = {}
    meet = (lambda: cut.frozen(st.epoch, st.generation)) if cut is not None else None
    try:
        captured = capture(layout, members, tmp, mountpoints,
                           _overlay_bases(layout, st, members, mode, base_meta), block_size=bs, timings=timings,
                           meet=meet, images=sources)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # nothing half-captured stays (a cut not met, a lost image)
        raise
    t_capture = time.monotonic() - t0
    captured_at = timings.get("frozen_at", captured_at)
    stats = ScanStats()
    pw = PlanWriter(tmp / "plan.bin")
    out_members = []
    used_fiemap = False
    try:
        for idx, vol in enumerate(members):
            cap = captured[vol]
            fd = os.open(cap.path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                new_mp = tmp / f"{vol}.map"
                base_img = None
                if mode == "compare":
                    exists, psize, ppath = peer_maps.get(vol, (False, 0, None))
                    fresh = not exists
                    base_size = psize if exists else 0
                    base_map = BlockMap.open(ppath) if exists else EmptyMap(bs)
                    new_map, from_base = BlockMap.create(new_mp, bs, size), False
                else:
                    base_mp = base_dir / f"{vol}.map"
                    fresh = not (st.generation > 0 and vol in st.members and vol in base_meta
                                 and base_mp.exists() and (base_dir / f"{vol}.img").exists())
                    if fresh:
                        base_size, base_map = 0, EmptyMap(bs)
                        new_map, from_base = BlockMap.create(new_mp, bs, size), False
                    else:
                        base_map = BlockMap.open(base_mp)
                        base_size = base_map.size
                        base_img = base_dir / f"{vol}.img"
                        copy_map(base_mp, new_mp)
                        new_map, from_base = BlockMap.open(new_mp, writable=True), True
                        new_map.resize(size)
                try:
                    use_fiemap = (not fresh and mode == "delta" and cap.reflinked
                                  and base_meta.get(vol, {}).get("reflinked", False))
                    if cap.overlay and not fresh:
                        ms, fiemapped = cap.scan, True
                    else:
                        ms, fiemapped = _member_scan(fd, size, base_img, base_size, bs, use_fiemap)
                    used_fiemap = used_fiemap or fiemapped
                    scan_member(idx, fd, size, base_map, new_map, from_base, ms, bs, pw, stats)
                    new_map.fsync()
                finally:
                    base_map.close()
                    new_map.close()
            finally:
                os.close(fd)
            out_members.append({"volume_id": vol, "size": size, "base_size": base_size,
                                "fresh": fresh, "reflinked": cap.reflinked, "overlay": cap.overlay})
    finally:
        pw.close()
    meta = {"txid": txid, "generation": target, "base_generation": base_generation, "mode": mode,
            "members": out_members, "records": pw.count, "block_size": bs, "fiemap": used_fiemap,
            "scanned": stats.scanned, "changed": stats.changed, "zeroed": stats.zeroed,
            "capture_s": t_capture, "freeze_s": timings.get("freeze_s", 0.0),
            "precopy_s": timings.get("precopy_s", 0.0),
            "round": timings.get("round"), "cut_wait_s": timings.get("cut_wait_s", 0.0),
            "ranges_cloned": sum(c.cloned for c in captured.values()),
            "plan_s": time.monotonic() - t0 - t_capture,
            "created_at": time.time(), "captured_at": captured_at, "complete": True}
    store.write_doc(tmp / "meta.json", meta)
    return Prepared(tmp, meta)


def adopt(layout: PoolLayout, st: UnitState, prepared: Prepared, *, epoch: int, peer_name: str,
           demote: bool = False, report: dict | None = None) -> None:
    """Record that the peer holds the prepared generation; it becomes the new base."""
    meta = prepared.meta
    old = st.generation
    st.generation = meta["generation"]
    st.txid = meta["txid"]
    st.members = [m["volume_id"] for m in meta["members"]]
    st.sizes = {m["volume_id"]: m["size"] for m in meta["members"]}
    st.block_size = meta["block_size"]
    st.epoch = max(st.epoch, epoch)
    st.peer = peer_name
    if demote:
        st.role, st.demoted, st.demoted_at = "secondary", True, st.generation
    if report is not None:
        st.add_report(report)
    save_state(layout.root, st)
    _roll(layout, st.unit_id, prepared.dir, meta)
    if old != st.generation:
        _rmtree(layout.snap_dir(st.unit_id, old))


def sync_unit(pool, unit_id: str, members, peer, *, mountpoints=(), epoch: int | None = None,
              demote: bool = False, mode: str = "delta", kind: str | None = None,
              block_size: int | None = None, bwlimit: float | None = None,
              compress: str = "auto", origin: dict | None = None, attempts: int = 1,
              cut=None, sources: dict | None = None) -> SyncReport:
    """Replicate one volume or group to *peer* and return the report (also kept in state.json).

    members: the volume ids of the unit (one for a volume unit). mountpoints:
    filesystems to freeze during the snapshot. epoch: the fencing epoch (None:
    the unit's). demote: carry a planned-failover demotion mark and make this
    site secondary once the peer commits. mode "compare": diff against the
    peer's block hashes instead of our acked snapshot (resync after split brain).
    attempts: how many times to plan and run again after a lost connection.
    cut: this unit is one node's part of a group spanning storage nodes
    (``replication.cut``): captures meet the other parts, commits are two-phase.
    sources: volume id -> a file to capture instead of the live image (a CSI snapshot
    shipped as a recovery point, named in ``origin["point"]``).
    """
    if mode not in MODES:
        raise InvalidParameter(key="mode", reason=f"must be one of {MODES}")
    if compress not in ("auto", "off", "always"):
        raise InvalidParameter(key="compress", reason="auto, off or always")
    layout = PoolLayout(pool)
    check_id(unit_id)
    members = [check_id(m, "volume id") for m in members]
    if not members or len(set(members)) != len(members):
        raise InvalidParameter(key="members", reason="one or more distinct volume ids")
    layout.ensure_unit_dir(unit_id)
    layout.snap_root(unit_id).mkdir(exist_ok=True)
    report = SyncReport(unit_id=unit_id, mode=mode, started_at=time.time(), members=list(members))
    t0 = time.monotonic()
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        st = _primary_state(pool, unit_id, members, kind=kind, epoch=epoch, block_size=block_size)
        report.epoch = epoch = st.epoch if epoch is None else epoch
        job = Job(layout, unit_id, members, peer, mountpoints=tuple(mountpoints), epoch=epoch,
                  demote=demote, mode=mode, compress=compress, bwlimit=bwlimit, origin=origin, cut=cut,
                  sources=sources)
        drive(job, lambda: _primary_state(pool, unit_id, members, kind=kind, epoch=epoch,
                                          block_size=block_size), report, attempts=attempts)
    report.duration_s = time.monotonic() - t0
    return report


def _primary_state(pool, unit_id, members, *, kind, epoch, block_size) -> UnitState:
    """The unit's state, checked: this site is primary and *epoch* is not stale."""
    st = find_state(pool, unit_id)
    if st is None:
        st = UnitState(unit_id=unit_id, members=list(members), role="primary",
                       kind=kind or ("volume" if members == [unit_id] else "group"),
                       block_size=check_block_size(block_size or DEFAULT_BLOCK_SIZE))
    elif kind:
        st.kind = kind
    if st.role != "primary":
        raise NotPrimary(unit_id=unit_id, role=st.role)
    if epoch is not None and epoch < st.epoch:
        raise StaleEpoch(unit_id=unit_id, epoch=epoch, have=st.epoch)
    if st.generation == 0 and block_size:
        st.block_size = check_block_size(block_size)
    return st


def stream(session: ApplySession, prepared: Prepared, report: SyncReport, *, unit_id, epoch,
            demote, kind, peer_name, compress, origin=None, progress_path=None,
            two_phase: bool = False) -> None:
    """Send the prepared generation and its trailer. two_phase: the peer only prepares it
    (votes) and waits for the round's decision (``ApplySession.decide``)."""
    meta = prepared.meta
    plan_path = prepared.dir / "plan.bin"
    t0 = time.monotonic()
    tx = {"txid": meta["txid"], "kind": kind, "base": meta["base_generation"],
          "target": meta["generation"], "epoch": epoch, "block_size": meta["block_size"],
          "mode": meta["mode"], "force": meta["mode"] == "compare", "demote": demote,
          "peer": (origin or {}).get("site") or os.uname().nodename, "origin": origin,
          "captured_at": meta.get("captured_at"),
          "two_phase": two_phase, "round": meta.get("round") if two_phase else None,
          "members": [{k: m[k] for k in ("volume_id", "size", "base_size", "fresh")}
                      for m in meta["members"]]}
    ready = session.begin(tx)
    skip = int(ready.get("resume_records") or 0)
    if skip and (skip > meta["records"] or manifest_of(plan_path, skip).hexdigest() != ready.get("manifest")):
        log.warning("peer journal of %s does not match our plan; restarting it", unit_id)
        session.restart()
        skip = 0
    fds = [os.open(member_file(prepared.dir, m), os.O_RDONLY) for m in meta["members"]]
    prog = Progress(progress_path, planned=meta["changed"], generation=meta["generation"]) if progress_path else None
    try:
        try:
            sent, chain = stream_records(plan_path, fds, prog.wrap(session.send) if prog else session.send,
                                         skip=skip, codec=AdaptiveCodec(compress))
        except ReplicationConflict as e:
            raise ReplicationConflict(unit_id=unit_id, reason=e.fields.get("reason", str(e))) from None
    finally:
        for fd in fds:
            os.close(fd)
        if prog:
            prog.done()
    reply = session.commit(chain.count, chain.hexdigest(), expect="prepared" if two_phase else "committed")
    if reply.get("txid") != meta["txid"] or reply.get("target" if two_phase else "generation") != meta["generation"]:
        raise ReplicationConflict(unit_id=unit_id, reason=f"peer committed {reply}, expected {meta['txid']}")
    report.phases["stream_s"] = round(time.monotonic() - t0, 4)
    for k in ("sync_s", "apply_s"):          # the peer's commit, inside stream_s
        if isinstance(reply.get(k), (int, float)):
            report.phases[f"peer_{k}"] = reply[k]
    report.txid = meta["txid"]
    report.base_generation = meta["base_generation"]
    report.target_generation = meta["generation"]
    report.members = [m["volume_id"] for m in meta["members"]]
    report.bytes_scanned = meta["scanned"]
    report.bytes_changed = meta["changed"]
    report.bytes_zeroed = meta["zeroed"]
    report.records = meta["records"]
    report.records_sent = sent
    report.reflink = bool(meta.get("fiemap"))
    report.ranges_cloned = int(meta.get("ranges_cloned", 0))
    report.phases["capture_s"] = round(meta.get("capture_s", 0), 4)
    report.phases["plan_s"] = round(meta.get("plan_s", 0), 4)
    report.phases["freeze_s"] = round(meta.get("freeze_s", 0), 4)
    report.phases["precopy_s"] = round(meta.get("precopy_s", 0), 4)
    if two_phase:
        report.phases["cut_wait_s"] = round(meta.get("cut_wait_s", 0), 4)
    report.bytes_on_wire = session.bytes_sent   # the whole conversation, control included


def release_unit(pool, unit_id: str) -> bool:
    """Forget the local replication state of a unit (snapshots, maps, state.json)."""
    layout = PoolLayout(pool)
    d = layout.unit_dir(unit_id)
    if not d.exists():
        return False
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        store.remove(layout.state_path(unit_id))
        for child in d.iterdir():
            if child.name != ".lock":
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    shutil.rmtree(d, ignore_errors=True)
    return True
