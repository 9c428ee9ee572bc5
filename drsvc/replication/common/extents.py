"""Ranges of a file's extent map (FIEMAP): where it holds data, and where two maps share
physical blocks.

Two forms of one answer: lists of (start, end) pairs from ``host.fiemap.Extent`` lists (a
CSI metadata reply, and the reference the planner's tests hold the arrays to), and range
sets (``ranges``) from numpy extent arrays (``host.fiemap.fiemap_array``: a capture, where
an aged image has ~10^5 extents).

Unwritten (preallocated) extents read as zeros: they are not data. Two immutable files
that map a logical offset to the same physical bytes hold the same data there; an extent
whose physical address the kernel does not vouch for (``UNTRUSTED_PHYSICAL``) is never
taken as shared.
"""
from __future__ import annotations

from ...host.fiemap import FIEMAP_EXTENT_UNWRITTEN, UNTRUSTED_PHYSICAL, Extent
from . import ranges


def data_intervals(extents, size: int) -> list[tuple[int, int]]:
    """Byte ranges holding data, below *size*."""
    return ranges.pairs(ranges.from_pairs((e.logical, min(e.end, size)) for e in extents
                                          if not e.flags & FIEMAP_EXTENT_UNWRITTEN and e.logical < size))


def shared_intervals(new: list[Extent], base: list[Extent]) -> list[tuple[int, int]]:
    """Ranges where both files map the same logical offset to the same physical bytes."""
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
    return ranges.pairs(ranges.from_pairs(out))


def data_ranges(arr, size: int):
    """``data_intervals`` of an extent array, as a range set."""
    import numpy as np
    ok = ((arr["flags"] & np.uint32(FIEMAP_EXTENT_UNWRITTEN)) == 0) & (arr["logical"] < size)
    s = arr["logical"][ok].astype(np.int64)
    return ranges.normalize(s, np.minimum(s + arr["length"][ok].astype(np.int64), size))


def _trusted(arr):
    """The extents whose physical address counts, by logical offset: (starts, ends, physical - logical)."""
    import numpy as np
    ok = (arr["flags"] & np.uint32(UNTRUSTED_PHYSICAL | FIEMAP_EXTENT_UNWRITTEN)) == 0
    s = arr["logical"][ok].astype(np.int64)
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = s + arr["length"][ok].astype(np.int64)[order]
    shift = arr["physical"][ok].astype(np.int64)[order] - s
    return s, e, shift


def shared_ranges(new, base):
    """``shared_intervals`` of two extent arrays, as a range set."""
    ns, ne, nshift = _trusted(new)
    bs_, be, bshift = _trusted(base)
    lo, hi = ranges.segments((ns, ne), (bs_, be))
    in_new, i = ranges.covered(ns, ne, lo)
    in_base, j = ranges.covered(bs_, be, lo)
    same = in_new & in_base
    if len(lo) and same.any():
        same &= nshift[i] == bshift[j]
    return ranges.normalize(lo[same], hi[same])
