"""What changed since the base: byte ranges to hash and to clear, and changed block runs.

Pure: nothing here does I/O. On a reflink pool only ranges whose physical mapping differs
from the base's need hashing (``plan_from_extent_arrays``; ``plan_from_extents`` is the
same plan from extent lists, the reference the arrays are tested against); without
reflink every data range is hashed (``plan_full_scan``). The range algebra is
``common.ranges``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...host.fiemap import Extent
from ..common import extents, ranges
from ..common.blockmap import DIGEST, ZERO

Interval = tuple[int, int]


@dataclass
class MemberScan:
    """What to do for one image: hash `scan` ranges and compare them with the base
    map; emit zero records for base-non-zero blocks inside `clear` ranges."""
    scan: list[Interval] = field(default_factory=list)
    clear: list[Interval] = field(default_factory=list)


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
    """Reflink pools: only ranges whose physical mapping differs need hashing. From extent
    lists (``host.fiemap.Extent``): the reference ``plan_from_extent_arrays`` is tested to."""
    return _plan(ranges.from_pairs(extents.data_intervals(new, new_size)),
                 ranges.from_pairs(extents.data_intervals(base, min(base_size, new_size))),
                 ranges.from_pairs(extents.shared_intervals(new, base)), new_size, base_size, bs)


def plan_from_extent_arrays(new, base, new_size: int, base_size: int, bs: int) -> MemberScan:
    """plan_from_extents for numpy extent arrays (``host.fiemap.fiemap_array``): no Python
    loop per extent, so an aged image's extent count costs vector work, not interpreter time."""
    return _plan(extents.data_ranges(new, new_size), extents.data_ranges(base, min(base_size, new_size)),
                 extents.shared_ranges(new, base), new_size, base_size, bs)


def _plan(new_data, base_data, shared, new_size: int, base_size: int, bs: int) -> MemberScan:
    """Hash what is data and not shared with the base, and the blocks around what became a
    hole; clear the whole blocks that became holes (range sets in, lists out)."""
    changed = ranges.subtract(new_data, shared)
    cleared = ranges.subtract(base_data, new_data)
    whole_cleared = ranges.round_in(cleared, bs)
    scan = ranges.union(ranges.round_out(changed, bs, new_size),
                        ranges.subtract(ranges.round_out(cleared, bs, new_size), whole_cleared),
                        ranges.from_pairs(_boundary_blocks(new_size, base_size, bs)))
    return MemberScan(scan=ranges.pairs(scan), clear=ranges.pairs(ranges.subtract(whole_cleared, scan)))


def plan_full_scan(new_data: list[Interval], new_size: int, base_size: int, bs: int) -> MemberScan:
    """Pools without reflink (or compare mode): hash all data of the new image; every
    hole that overlaps the base may hide a block the base had, so it is cleared."""
    scan = ranges.union(ranges.round_out(ranges.from_pairs(new_data), bs, new_size),
                        ranges.from_pairs(_boundary_blocks(new_size, base_size, bs)))
    limit = min(new_size, base_size)
    holes = ranges.subtract(ranges.of([0], [limit]), scan) if limit else ranges.empty()
    return MemberScan(scan=ranges.pairs(scan), clear=ranges.pairs(ranges.round_in(holes, bs)))


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
