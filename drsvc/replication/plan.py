"""Pure planning: (source maps, base maps, peer state) -> ranges and steps, or a typed conflict.

Nothing here does I/O. Intervals are half-open (start, end) byte ranges,
sorted and non-overlapping.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ReplicaIsPrimary, ReplicationConflict
from ..host.fiemap import (FIEMAP_EXTENT_UNWRITTEN,
                          UNTRUSTED_PHYSICAL, Extent)
from .blockmap import DIGEST, ZERO

Interval = tuple[int, int]


# -- interval algebra ---------------------------------------------------------
def normalize(intervals) -> list[Interval]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def subtract(a, b) -> list[Interval]:
    a, b = normalize(a), normalize(b)
    out = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def intersect(a, b) -> list[Interval]:
    a, b = normalize(a), normalize(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def round_out(intervals, bs: int, limit: int) -> list[Interval]:
    return normalize((s - s % bs, min(limit, -(-e // bs) * bs)) for s, e in intervals)


def round_in(intervals, bs: int) -> list[Interval]:
    return normalize((-(-s // bs) * bs, e - e % bs) for s, e in intervals)


def total(intervals) -> int:
    return sum(e - s for s, e in intervals)


# -- change detection ---------------------------------------------------------
@dataclass
class MemberScan:
    """What to do for one image: hash `scan` ranges and compare them with the base
    map; emit zero records for base-non-zero blocks inside `clear` ranges."""
    scan: list[Interval] = field(default_factory=list)
    clear: list[Interval] = field(default_factory=list)


def data_intervals(extents, size: int) -> list[Interval]:
    """Byte ranges holding data. Unwritten (preallocated) extents read as zeros: not data."""
    return normalize((e.logical, min(e.end, size)) for e in extents
                     if not e.flags & FIEMAP_EXTENT_UNWRITTEN and e.logical < size)


def shared_intervals(new: list[Extent], base: list[Extent]) -> list[Interval]:
    """Ranges where both files map the same logical offset to the same physical bytes.

    Both files are immutable snapshots, so shared physical blocks hold equal data."""
    new = sorted((e for e in new if not e.flags & (UNTRUSTED_PHYSICAL | FIEMAP_EXTENT_UNWRITTEN)),
                 key=lambda e: e.logical)
    base = sorted((e for e in base if not e.flags & (UNTRUSTED_PHYSICAL | FIEMAP_EXTENT_UNWRITTEN)),
                  key=lambda e: e.logical)
    out, i, j = [], 0, 0
    while i < len(new) and j < len(base):
        a, b = new[i], base[j]
        s, e = max(a.logical, b.logical), min(a.end, b.end)
        if s < e and a.physical - a.logical == b.physical - b.logical:
            out.append((s, e))
        if a.end < b.end:
            i += 1
        else:
            j += 1
    return normalize(out)


def _boundary_blocks(new_size: int, base_size: int, bs: int) -> list[Interval]:
    """When the size changes, the blocks holding either end-of-file are rescanned so
    the new map holds digests of their new (full or shortened) length."""
    if new_size == base_size:
        return []
    out = []
    for end in (base_size, new_size):
        if 0 < end <= new_size and end % bs:
            s = (end - 1) - (end - 1) % bs
            out.append((s, min(new_size, s + bs)))
    if base_size > new_size and new_size % bs:
        s = new_size - new_size % bs
        out.append((s, new_size))
    return out


def plan_from_extents(new: list[Extent], base: list[Extent], new_size: int, base_size: int,
                      bs: int) -> MemberScan:
    """Reflink pools: only ranges whose physical mapping differs need hashing."""
    new_data = data_intervals(new, new_size)
    base_data = data_intervals(base, min(base_size, new_size))
    changed = subtract(new_data, shared_intervals(new, base))
    cleared = subtract(base_data, new_data)
    whole_cleared = round_in(cleared, bs)
    scan = normalize(round_out(changed, bs, new_size)
                     + subtract(round_out(cleared, bs, new_size), whole_cleared)
                     + _boundary_blocks(new_size, base_size, bs))
    return MemberScan(scan=scan, clear=subtract(whole_cleared, scan))


def plan_from_extent_arrays(new, base, new_size: int, base_size: int, bs: int) -> MemberScan:
    """plan_from_extents for numpy extent arrays (host.fiemap.fiemap_array), computed
    on arrays (replication.extentplan): no Python loop per extent, so an aged
    image's extent count costs vector work, not interpreter time."""
    from .extentplan import plan_arrays
    scan, clear = plan_arrays(new, base, new_size, base_size, bs,
                              _boundary_blocks(new_size, base_size, bs))
    return MemberScan(scan=scan, clear=clear)


def plan_full_scan(new_data: list[Interval], new_size: int, base_size: int, bs: int) -> MemberScan:
    """Pools without reflink (or compare mode): hash all data of the new image; every
    hole that overlaps the base may hide a block the base had, so it is cleared."""
    scan = normalize(round_out(new_data, bs, new_size) + _boundary_blocks(new_size, base_size, bs))
    limit = min(new_size, base_size)
    holes = subtract([(0, limit)], scan) if limit else []
    return MemberScan(scan=scan, clear=round_in(holes, bs))


def changed_runs(new_digests: bytes, base_digests: bytes, first_block: int):
    """Runs of changed blocks as (first_block, count, is_zero), in order.

    Adjacent changed blocks of the same kind coalesce; the caller bounds run length.
    Long windows (a full scan) are compared as arrays, not block by block."""
    if new_digests == base_digests:
        return []
    n = len(new_digests) // DIGEST
    if n >= 32:
        return _changed_runs_array(new_digests, base_digests, first_block, n)
    runs = []
    run_start = -1
    run_zero = False
    for i in range(n):
        o = i * DIGEST
        nd = new_digests[o:o + DIGEST]
        if nd == base_digests[o:o + DIGEST]:
            if run_start >= 0:
                runs.append((first_block + run_start, i - run_start, run_zero))
                run_start = -1
            continue
        z = nd == ZERO
        if run_start >= 0 and z != run_zero:
            runs.append((first_block + run_start, i - run_start, run_zero))
            run_start = -1
        if run_start < 0:
            run_start, run_zero = i, z
    if run_start >= 0:
        runs.append((first_block + run_start, n - run_start, run_zero))
    return runs


def _changed_runs_array(new_digests, base_digests, first_block: int, n: int):
    import numpy as np
    a = np.frombuffer(new_digests, dtype=np.uint64, count=2 * n).reshape(n, 2)
    b = np.frombuffer(base_digests, dtype=np.uint64, count=2 * n).reshape(n, 2)
    changed = (a != b).any(axis=1)
    key = changed.astype(np.int8) + (changed & (a == 0).all(axis=1))   # 0 same, 1 data, 2 zero
    cut = np.flatnonzero(key[1:] != key[:-1]) + 1
    starts = np.concatenate(([0], cut))
    counts = np.diff(np.append(starts, n))
    kind = key[starts]
    sel = kind > 0
    return list(zip((starts[sel] + first_block).tolist(), counts[sel].tolist(), (kind[sel] == 2).tolist(),
                    strict=True))


def nonzero_runs(digests: bytes, first_block: int):
    """Runs of blocks whose digest is not ZERO, as (first_block, count)."""
    if digests == bytes(len(digests)):
        return []
    return [(b, c) for b, c, z in changed_runs(bytes(len(digests)), digests, first_block)]


# -- reconciliation with the peer ---------------------------------------------
@dataclass(frozen=True)
class Pending:
    """A captured and planned generation that the peer has not been seen to commit."""
    generation: int
    txid: str
    members: tuple


def reconcile(unit_id: str, acked: int, pending: Pending | None, peer: dict, members,
              mode: str = "delta") -> list[str]:
    """Steps to take given our acked generation and the peer's status.

    Returns a list among "settle" (carry a two-phase round's decision to the peer:
    ``peer["journal"]["decision"]``), "finalize" (the peer committed our pending generation:
    adopt it), "discard" (drop the pending generation), "resume" (stream the
    pending generation again; the peer keeps what it acked), "sync" (capture and
    send a new generation), "compare". Raises a typed conflict otherwise.
    """
    if peer.get("role") == "primary":
        raise ReplicaIsPrimary(unit_id=unit_id)
    if peer.get("resync_requested"):
        mode = "compare"          # the peer discards its divergence: diff against its blocks
    peer_gen = int(peer.get("generation") or 0)
    peer_txid = peer.get("txid")
    steps: list[str] = []
    jr = peer.get("journal") or {}
    if jr.get("prepared"):
        # a two-phase round (group spanning nodes) awaits its decision, read while connecting
        steps.append("settle")
        if jr.get("decision"):
            peer_gen, peer_txid = int(jr["target"]), jr["txid"]
        elif pending is not None and pending.txid == jr.get("txid"):
            steps.append("discard")
            pending = None
    if pending is not None:
        if peer_gen == pending.generation and peer_txid == pending.txid:
            steps.append("finalize")
            acked = pending.generation
            pending = None
        elif mode == "compare" or peer_gen != acked or tuple(members) != tuple(pending.members):
            steps.append("discard")
            pending = None
    if mode == "compare":
        return steps + ["compare"]
    if peer_gen != acked:
        if not peer.get("exists") and acked > 0:
            reason = f"peer has no replica but generation {acked} was acknowledged; a compare sync is needed"
        else:
            reason = (f"peer is at generation {peer_gen} but generation {acked} was acknowledged; "
                      "a compare sync is needed")
        raise ReplicationConflict(unit_id=unit_id, reason=reason)
    return steps + (["resume"] if pending is not None else ["sync"])
