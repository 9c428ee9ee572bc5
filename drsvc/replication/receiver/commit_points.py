"""Recovery points as the receiver commits: keep what a generation overwrites, prune.

Two calls from the receiver's commit, both under the unit lock and both repeat-safe (a
committed journal is replayed after a crash, and these run again with it):

* :func:`before_apply`, once the journal is committed and before it touches the images:
  the points the retention grid drops with this commit are folded into their older
  neighbours, then the ranges the generation changes are copied out of the replica into
  the undo logs of the point that keeps them (the newest point, or when the grid drops
  that one, the nearest older point kept). The target's meta.json records the txid last:
  a replay that finds it there does not copy again (the images may already be new).
* :func:`after_commit`, after the apply and before the unit's state is saved: the index
  gets the new point and loses the pruned ones in one atomic write; the CSI snapshots the
  point replicates are made (or the ones the origin deleted removed), and the pruned
  points' files go.

The decision is a pure function of the index, the transaction and its retention grid
(pins are judged at the new point's capture instant), so both calls and any replay of
them take the same one. Folding a point into its neighbour only fills ranges the
neighbour does not cover with bytes it holds there anyway, so it is safe at any step.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ... import retention, store
from ...errors import RetentionGridInvalid
from ...failpoints import failpoint
from ...layout import PoolLayout
from ...logs import logger
from ..common import ranges
from ..common.blockmap import DEFAULT_BLOCK_SIZE
from ..common.unit_state import find_state
from ..points import digests, undo_log
from ..points.index import (
    FULL,
    LIVE,
    SCHEDULED,
    UNDO,
    Index,
    Point,
    build_image,
    chain,
    ensure_point_dir,
    layers,
    member_data,
    read_meta,
    seal,
    undo_map,
    write_meta,
)

log = logger(__name__)


def grid_of(tx: dict) -> retention.Grid:
    """The primary's grid, carried in the origin block; the default when there is none."""
    text = ((tx.get("origin") or {}).get("retention")) or retention.DEFAULT_GRID
    try:
        return retention.parse_grid(text)
    except RetentionGridInvalid:
        log.warning("unit %s: unreadable retention grid %r; using the default", tx["unit"], text)
        return retention.parse_grid(retention.DEFAULT_GRID)


def new_point(tx: dict) -> Point:
    origin = tx.get("origin") or {}
    snap = origin.get("point")
    t = float((snap or {}).get("created_at") or tx.get("captured_at") or 0.0) or time.time()
    cut = None
    if tx["kind"] == "group":
        cut = {"round": tx.get("round"), "members": [m["volume_id"] for m in tx["members"]]}
    return Point(generation=tx["target"], time=t, kind=f"{snap['kind']}:{snap['id']}" if snap else SCHEDULED,
                 txid=tx["txid"], received_at=time.time(), pinned=bool(snap),
                 members={m["volume_id"]: m["size"] for m in tx["members"]}, cut=cut, snapshot=snap)


def still_pinned(p: Point, listed, now: float) -> bool:
    """A replicated CSI snapshot stays pinned while the origin still lists it."""
    if p.pinned and p.snapshot and listed is not None and p.snapshot["id"] not in listed:
        return (p.pin_until or 0.0) > now
    return p.is_pinned(now)


@dataclass
class Plan:
    kept: set                  # generations kept after this commit, the new one included
    pruned: list               # Points dropped, oldest first
    unpinned: list             # Points whose CSI snapshot the origin deleted

    @classmethod
    def of(cls, idx: Index, new: Point, grid: retention.Grid, listed) -> Plan:
        pts = list(idx.points)
        if any(p.kind == new.kind for p in pts) and new.kind != SCHEDULED:
            new.kind, new.pinned, new.snapshot = SCHEDULED, False, None     # shipped again: kept once
        entries = [(p.time, still_pinned(p, listed, new.time)) for p in pts] + [(new.time, True)]
        keep = retention.kept(grid, entries)
        kept = {pts[i].generation for i in keep if i < len(pts)} | {new.generation}
        unpinned = [p for p in pts if p.pinned and not still_pinned(p, listed, new.time) and p.snapshot]
        return cls(kept, [p for p in pts if p.generation not in kept], unpinned)

    def survivor(self, idx: Index, p: Point) -> Point | None:
        """The nearest older point kept: the one that takes over a pruned point's bytes."""
        older = [q for q in idx.points if q.generation < p.generation and q.generation in self.kept]
        return older[-1] if older else None

    def target(self, idx: Index) -> Point | None:
        newest = idx.newest
        return newest if newest.generation in self.kept else self.survivor(idx, newest)


def _plan(idx: Index, tx: dict) -> tuple[Plan, Point]:
    new = new_point(tx)
    listed = (tx.get("origin") or {}).get("snapshots")
    return Plan.of(idx, new, grid_of(tx), None if listed is None else set(listed)), new


def undo_target(idx: Index, tx: dict) -> Point | None:
    """The point whose undo logs keep what *tx* overwrites once it commits (None: no point
    keeps it). The same answer at the transaction's begin as at its commit: the plan is a
    function of the index and the transaction."""
    if not idx.points:
        return None
    return _plan(idx, tx)[0].target(idx)


# -- before the apply -------------------------------------------------------------------
def keeps_undo(layout: PoolLayout, unit_id: str) -> bool:
    """Whether a commit to the unit may copy what it overwrites into an undo log: it has a
    points index. Asked at every transaction's begin, so the index is not parsed here
    (``before_apply`` reads it once, at the commit)."""
    return layout.points_index(unit_id).exists()


_COSTS: dict = {}                 # txid -> seconds spent before the apply (this process)
_PARSED: dict = {}                # txid -> (the index file's identity, the Index before_apply read)


def _file_key(path) -> tuple | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _index_before_apply(layout: PoolLayout, tx: dict) -> Index | None:
    """The index, read for before_apply and kept for the same transaction's after_commit."""
    _PARSED.clear()
    key = _file_key(layout.points_index(tx["unit"]))
    idx = Index.find(layout, tx["unit"])
    if idx is not None:
        _PARSED[tx["txid"]] = (key, idx)
    return idx


def _index_for_commit(layout: PoolLayout, tx: dict) -> Index:
    """The index as before_apply read it for this transaction, when the file is still the
    one it read (nothing wrote it since: the index is written only after the apply), else
    read again. Saves a parse per commit, which grows with the points kept."""
    cached = _PARSED.pop(tx["txid"], None)
    if cached is not None and cached[0] == _file_key(layout.points_index(tx["unit"])):
        return cached[1]
    return Index.load(layout, tx["unit"])


def before_apply(layout: PoolLayout, tx: dict, spans, early: dict | None = None) -> None:
    """*spans*: a callable giving the journal's (member index, offset, length) records.
    *early*: volume id -> ``undo_copy.Early``, what this process copied as the records came."""
    t0 = time.monotonic()
    idx = _index_before_apply(layout, tx)
    if idx is None or not idx.points or idx.has_txid(tx["txid"]):
        return
    plan, _ = _plan(idx, tx)
    leaving = set(idx.newest.members) - {m["volume_id"] for m in tx["members"]}
    if leaving:
        seal(layout, idx, leaving)       # out of the unit: its image is no longer ours to keep
    t_fold = time.monotonic()
    for p in plan.pruned:
        fold(layout, idx, p, plan.survivor(idx, p))
        failpoint("points.after_fold")
    t1 = time.monotonic()
    target = plan.target(idx)
    if target is not None:
        keep_overwritten(layout, idx, target, tx, spans, early)
    _COSTS.clear()
    _COSTS[tx["txid"]] = {"prune_s": t1 - t0, "fold_s": t1 - t_fold,
                          "undo_s": time.monotonic() - t1 if target is not None else 0.0}


def undo_seconds(txid: str) -> float:
    """What this process's ``before_apply`` of *txid* spent copying what it overwrites (0 when
    it copied nothing). Read before ``after_commit``, which records and forgets it."""
    return float(_COSTS.get(txid, {}).get("undo_s", 0.0))


def keep_overwritten(layout: PoolLayout, idx: Index, target: Point, tx: dict, spans, early: dict | None = None) -> None:
    """Copy what the transaction overwrites out of the replica into *target*'s undo logs.
    A member the newest point held live starts from its *early* copies (``undo_copy``: made
    into this point's log as the records arrived, named by no map until now), when it is the
    newest point they were made for; only what they miss is copied here."""
    unit, newest = idx.unit_id, idx.newest
    meta = read_meta(layout, unit, target.generation)
    if meta.get("undo_txid") == tx["txid"]:
        return                           # done before a crash: the images may be new already
    live = read_meta(layout, unit, newest.generation) if target is not newest else dict(meta, members=dict(meta["members"]))
    for vol in target.members:           # the newest point stops being the replica
        if target is newest and member_data(meta, vol) == LIVE:
            got = (early or {}).get(vol)
            if got is not None and got.generation == target.generation:
                meta["members"][vol] = {"data": UNDO, "map": undo_log.encode_map(got.rows), "bytes": got.nbytes}
            else:
                meta["members"][vol] = {"data": UNDO, "map": "", "bytes": 0}
    for vol, changed in undo_log.changed_ranges(spans(), tx).items():
        # the replica holds the newest point's bytes of vol (live there), and target keeps an undo of vol
        if (vol not in target.members or vol not in newest.members or member_data(live, vol) != LIVE
                or member_data(meta, vol, newest=target is newest) != UNDO):
            continue
        have = undo_map(meta, vol)
        want = ranges.subtract(changed, undo_log.covered(have))
        if not len(want[0]):
            continue
        ensure_point_dir(layout, unit, target.generation)
        fd = os.open(layout.image(vol), os.O_RDONLY)
        try:
            rows, n = undo_log.append(layout.point_undo(unit, target.generation, vol),
                                       undo_log.image_pieces(fd, want, os.fstat(fd).st_size), after=have,
                                       sums=layout.point_undo_sums(unit, target.generation, vol))
        finally:
            os.close(fd)
        _add(meta, vol, have, rows, n)
    failpoint("points.mid_undo")         # the copies durable (made here or as the records came), no map names them
    meta["undo_txid"] = tx["txid"]
    write_meta(layout, unit, meta)


def _add(meta: dict, vol: str, have, rows, n: int) -> None:
    entry = meta["members"].setdefault(vol, {"data": UNDO, "map": "", "bytes": 0})
    entry["map"] = undo_log.encode_map(undo_log.merge_maps(have, rows))
    entry["bytes"] = int(entry.get("bytes", 0)) + n


def fold(layout: PoolLayout, idx: Index, p: Point, q: Point | None) -> None:
    """Hand what pruned point *p* keeps to *q*, the nearest older point kept (None: p is
    the oldest and nothing needs it). Repeat-safe."""
    if q is None:
        return
    unit = idx.unit_id
    pmeta, qmeta = read_meta(layout, unit, p.generation), read_meta(layout, unit, q.generation)
    changed = False
    for vol in p.members:
        pk = member_data(pmeta, vol, newest=p is idx.newest)
        if pk == LIVE or vol not in q.members or member_data(qmeta, vol, newest=False) != UNDO:
            continue                     # live: the undo step keeps it; q whole or without vol
        if pk == FULL:
            _make_full(layout, idx, q, vol)
            qmeta["members"][vol] = {"data": FULL, "map": "", "bytes": 0}
            changed = True
            continue
        have = undo_map(qmeta, vol)
        pmap = undo_map(pmeta, vol)
        moved = undo_log.clip(pmap, ranges.subtract(undo_log.covered(pmap), undo_log.covered(have)))
        if not len(moved):
            continue
        fd = os.open(layout.point_undo(unit, p.generation, vol), os.O_RDONLY) if (moved[:, 2] >= 0).any() else -1
        try:
            rows, n = undo_log.append_rows(layout.point_undo(unit, q.generation, vol), fd,
                                            undo_log.in_log_order(moved), after=have,
                                            sums=layout.point_undo_sums(unit, q.generation, vol),
                                            src_sums=layout.point_undo_sums(unit, p.generation, vol))
        finally:
            if fd >= 0:
                os.close(fd)
        _add(qmeta, vol, have, rows, n)
        changed = True
    if changed:
        write_meta(layout, unit, qmeta)


def _make_full(layout: PoolLayout, idx: Index, q: Point, vol: str) -> None:
    """q's newer neighbour, a whole image, goes: q becomes a whole image itself."""
    final = layout.point_image(idx.unit_id, q.generation, vol)
    tmp = layout.staging_image(final)
    build_image(layout, idx, q, vol, tmp)
    base, overlays = chain(layout, idx, q, vol)
    digests.record_built_image(tmp, layout.point_image_map(idx.unit_id, q.generation, vol), _block_size(layout, idx),
                               base, layers(overlays))
    os.replace(tmp, final)


def _block_size(layout: PoolLayout, idx: Index) -> int:
    st = find_state(layout.root, idx.unit_id)
    return int(st.block_size) if st is not None and st.block_size else DEFAULT_BLOCK_SIZE


# -- after the apply ----------------------------------------------------------------------
def after_commit(layout: PoolLayout, tx: dict) -> None:
    t0 = time.monotonic()
    idx = _index_for_commit(layout, tx)
    listed = (tx.get("origin") or {}).get("snapshots")
    if idx.has_txid(tx["txid"]):         # a replay: the index is written; finish the rest
        gone = [p for p in idx.points if p.snapshot and not p.pinned and listed is not None
                and p.snapshot["id"] not in listed]
        _snapshots(layout, idx.get(tx["target"]), gone)
        sweep(layout, idx)
        return
    plan, new = _plan(idx, tx)
    touched = {q.generation for p in plan.pruned if (q := plan.survivor(idx, p))}
    if idx.newest is not None and (t := plan.target(idx)) is not None:
        touched.add(t.generation)
    for p in plan.unpinned:
        p.pinned = False
    idx.points = [p for p in idx.points if p.generation in plan.kept] + [new]
    for p in idx.points:
        if p.generation in touched:
            meta = read_meta(layout, idx.unit_id, p.generation)
            p.unique_bytes = sum(int(m.get("bytes", 0)) for m in meta["members"].values())
    idx.grid = grid_of(tx).text
    failpoint("points.before_index")
    t1 = time.monotonic()
    idx.save(layout)
    t2 = time.monotonic()
    failpoint("points.after_index")
    _snapshots(layout, new, plan.unpinned)
    t3 = time.monotonic()
    for p in plan.pruned:
        store.remove_tree(layout.point_dir(idx.unit_id, p.generation), ignore_errors=True)
    for g in touched:
        _sweep_point(layout, idx.unit_id, layout.point_dir(idx.unit_id, g))
    remove_s = time.monotonic() - t3
    _record_costs(layout, tx, idx, plan, (t1 - t0) + remove_s, t2 - t1, remove_s)


def _record_costs(layout: PoolLayout, tx: dict, idx: Index, plan: Plan, prune_s: float, index_s: float,
                  remove_s: float) -> None:
    """What this commit spent on points, for the bench and for operators (not made durable):
    prune_s is the plan, the folds and the removal of the pruned points (fold_s and
    remove_s of it); undo_s the copy of what the generation overwrites; index_s the index
    write."""
    before = _COSTS.pop(tx["txid"], {})
    doc = {"txid": tx["txid"], "generation": tx["target"], "points": len(idx.points), "pruned": len(plan.pruned),
           "prune_s": round(prune_s + before.get("prune_s", 0.0), 6), "fold_s": round(before.get("fold_s", 0.0), 6),
           "remove_s": round(remove_s, 6), "undo_s": round(before.get("undo_s", 0.0), 6),
           "index_s": round(index_s, 6)}
    store.atomic_write_bytes(layout.points_costs(idx.unit_id), json.dumps(doc).encode(), durable=False)


def _snapshots(layout: PoolLayout, new: Point | None, gone) -> None:
    """The CSI snapshots at this site follow the origin's: made for the new point, removed
    when the origin no longer lists them (repeat-safe both)."""
    from . import origin_block as unit_origin
    if new is not None and new.snapshot:
        unit_origin.ensure_snapshot_replica(layout.root, new.snapshot, new.time)
    for q in gone:
        unit_origin.drop_snapshot_replica(layout.root, q.snapshot)


def sweep(layout: PoolLayout, idx: Index) -> None:
    """Remove the files of points no longer listed, and whatever a crash left half made."""
    root = layout.points_dir(idx.unit_id)
    if not root.exists():
        return
    kept = {str(p.generation) for p in idx.points}
    for d in root.iterdir():
        if d.is_dir() and d.name not in kept:
            store.remove_tree(d, ignore_errors=True)
        elif d.is_dir():
            _sweep_point(layout, idx.unit_id, d)


def _sweep_point(layout: PoolLayout, unit: str, d: Path) -> None:
    if not d.exists():
        return
    meta = read_meta(layout, unit, int(d.name))
    for f in d.iterdir():
        vol = f.name.removesuffix(".sums").removesuffix(".undo") if f.name.endswith((".undo", ".undo.sums")) else ""
        stale_undo = bool(vol) and member_data(meta, vol, newest=False) == FULL
        if f.name.startswith(".") or stale_undo:
            f.unlink(missing_ok=True)
