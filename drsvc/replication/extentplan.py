"""plan.plan_from_extents on numpy arrays: the extent diff without a Python loop per extent.

An aged 1 GiB image has ~10^5 extents and a 10% change leaves ~5*10^4 of them
different from the base, so the interval algebra runs on int64 arrays of starts
and ends. Every operation works on *elementary segments*: the sorted union of all
boundary points cuts the line into pieces that each lie wholly inside or outside
every input interval, so coverage is one ``searchsorted`` per input and set
operations are boolean masks. The result equals ``plan.plan_from_extents`` (the
reference, tested against it), as lists of (start, end) tuples.
"""
from __future__ import annotations

import numpy as np

from ..host.fiemap import FIEMAP_EXTENT_UNWRITTEN, UNTRUSTED_PHYSICAL

I64 = np.int64


def _pair(s, e):
    return np.asarray(s, dtype=I64), np.asarray(e, dtype=I64)


def normalize(s, e):
    """Sorted, disjoint, touching intervals merged (as plan.normalize)."""
    s, e = _pair(s, e)
    keep = e > s
    s, e = s[keep], e[keep]
    if not len(s):
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    head = np.empty(len(s), dtype=bool)
    head[0] = True
    head[1:] = s[1:] > reach[:-1]
    starts = s[head]
    last = np.append(np.flatnonzero(head)[1:] - 1, len(s) - 1)
    return starts, reach[last]


def _covered(s, e, p):
    """For points p: inside one of the sorted disjoint intervals [s, e)."""
    i = np.searchsorted(s, p, side="right") - 1
    ok = i >= 0
    ic = np.maximum(i, 0)
    return ok & (e[ic] > p) if len(s) else np.zeros(len(p), dtype=bool), ic


def boundaries(*arrays):
    """The distinct values of int64 *arrays*, sorted. A sort and a mask: numpy 2's
    ``np.unique`` goes through a hash table first and measured 14-36x slower here
    (4.6 ms against 0.36 ms at 20,000 values, 143 ms against 4 ms at 200,000)."""
    v = np.sort(np.concatenate(arrays)) if arrays else np.zeros(0, dtype=I64)
    if len(v) < 2:
        return v
    keep = np.empty(len(v), dtype=bool)
    keep[0] = True
    np.not_equal(v[1:], v[:-1], out=keep[1:])
    return v[keep]


def _segments(*ivals):
    pts = boundaries(*[np.asarray(x, dtype=I64) for iv in ivals for x in iv])
    return pts[:-1], pts[1:]


def _merge(p, q, mask):
    return normalize(p[mask], q[mask])


def subtract(a, b):
    a, b = normalize(*a), normalize(*b)
    p, q = _segments(a, b)
    return _merge(p, q, _covered(*a, p)[0] & ~_covered(*b, p)[0])


def union(*ivals):
    return normalize(np.concatenate([iv[0] for iv in ivals]), np.concatenate([iv[1] for iv in ivals]))


def round_out(iv, bs: int, limit: int):
    s, e = iv
    return normalize(s - s % bs, np.minimum(limit, -(-e // bs) * bs))


def round_in(iv, bs: int):
    s, e = iv
    return normalize(-(-s // bs) * bs, e - e % bs)


def _data(arr, size: int):
    ok = ((arr["flags"] & np.uint32(FIEMAP_EXTENT_UNWRITTEN)) == 0) & (arr["logical"] < size)
    s = arr["logical"][ok].astype(I64)
    return normalize(s, np.minimum(s + arr["length"][ok].astype(I64), size))


def _trusted(arr):
    ok = (arr["flags"] & np.uint32(UNTRUSTED_PHYSICAL | FIEMAP_EXTENT_UNWRITTEN)) == 0
    s = arr["logical"][ok].astype(I64)
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = s + arr["length"][ok].astype(I64)[order]
    shift = arr["physical"][ok].astype(I64)[order] - s
    return s, e, shift


def shared(new, base):
    """Ranges where both files map a logical offset to the same physical bytes."""
    ns, ne, nshift = _trusted(new)
    bs_, be, bshift = _trusted(base)
    p, q = _segments((ns, ne), (bs_, be))
    in_new, i = _covered(ns, ne, p)
    in_base, j = _covered(bs_, be, p)
    same = in_new & in_base
    if len(p) and same.any():
        same &= nshift[i] == bshift[j]
    return _merge(p, q, same)


def _as_list(iv):
    return list(zip(iv[0].tolist(), iv[1].tolist(), strict=True))


def plan_arrays(new, base, new_size: int, base_size: int, bs: int, boundary):
    """(scan, clear) as lists of intervals; *boundary* are plan._boundary_blocks."""
    new_data = _data(new, new_size)
    base_data = _data(base, min(base_size, new_size))
    changed = subtract(new_data, shared(new, base))
    cleared = subtract(base_data, new_data)
    whole_cleared = round_in(cleared, bs)
    bnd = _pair([s for s, _ in boundary], [e for _, e in boundary])
    scan = union(round_out(changed, bs, new_size),
                 subtract(round_out(cleared, bs, new_size), whole_cleared), bnd)
    return _as_list(scan), _as_list(subtract(whole_cleared, scan))
