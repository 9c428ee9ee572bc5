"""Range sets: the engine's one interval algebra.

A range set is a pair of int64 arrays ``(starts, ends)`` of half-open byte ranges, sorted,
disjoint and never touching (ranges that touch are one). An aged 1 GiB image has ~10^5
extents, so every operation is vector work on the arrays, not a Python loop per range:
the sorted union of all boundary points cuts the line into *elementary segments* that each
lie wholly inside or outside every input, so coverage is one ``searchsorted`` per input
and a set operation is a boolean mask over the segments.

Lists of ``(start, end)`` pairs (a plan's ``MemberScan``, a CSI metadata reply) come in
with :func:`from_pairs` and go out with :func:`pairs`.

numpy is imported on first use, so a receiver that only answers ``hello`` or ``status``
never loads it.
"""
from __future__ import annotations


def _np():
    import numpy
    return numpy


def of(starts, ends):
    """The two arrays of *starts* and *ends*, as int64 (not normalized)."""
    np = _np()
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def empty():
    return of((), ())


def normalize(starts, ends):
    """The range set of the ranges [starts[i], ends[i]): sorted, empty ones dropped,
    overlapping and touching ones merged."""
    np = _np()
    s, e = of(starts, ends)
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
    last = np.append(np.flatnonzero(head)[1:] - 1, len(s) - 1)
    return s[head], reach[last]


def from_pairs(pairs_):
    """The range set of an iterable of (start, end) pairs."""
    pairs_ = list(pairs_)
    return normalize([s for s, _ in pairs_], [e for _, e in pairs_])


def pairs(r) -> list[tuple[int, int]]:
    """A range set as a list of (start, end) tuples of Python ints."""
    return list(zip(r[0].tolist(), r[1].tolist(), strict=True))


def total(r) -> int:
    """Bytes the range set covers."""
    return int((r[1] - r[0]).sum()) if len(r[0]) else 0


def boundaries(*arrays):
    """The distinct values of int64 *arrays*, sorted. A sort and a mask: numpy's
    ``np.unique`` goes through a hash table first, an order of magnitude slower at these
    sizes."""
    np = _np()
    v = np.sort(np.concatenate(arrays)) if arrays else np.zeros(0, dtype=np.int64)
    if len(v) < 2:
        return v
    keep = np.empty(len(v), dtype=bool)
    keep[0] = True
    np.not_equal(v[1:], v[:-1], out=keep[1:])
    return v[keep]


def covered(starts, ends, points):
    """For each of *points*: whether it lies in one of the range set's ranges, and the
    index of the last range starting at or before it (0 when none does)."""
    np = _np()
    i = np.searchsorted(starts, points, side="right") - 1
    ic = np.maximum(i, 0)
    inside = (i >= 0) & (ends[ic] > points) if len(starts) else np.zeros(len(points), dtype=bool)
    return inside, ic


def segments(*sets):
    """The elementary segments (lo, hi) that the boundaries of every one of *sets* cut."""
    np = _np()
    pts = boundaries(*[np.asarray(x, dtype=np.int64) for r in sets for x in r])
    return pts[:-1], pts[1:]


def union(*sets):
    np = _np()
    if not sets:
        return empty()
    return normalize(np.concatenate([r[0] for r in sets]), np.concatenate([r[1] for r in sets]))


def subtract(a, b):
    """What *a* covers and *b* does not (either may be unnormalized)."""
    a, b = normalize(*a), normalize(*b)
    lo, hi = segments(a, b)
    keep = covered(*a, lo)[0] & ~covered(*b, lo)[0]
    return normalize(lo[keep], hi[keep])


def intersect(a, b):
    """What both *a* and *b* cover (either may be unnormalized)."""
    a, b = normalize(*a), normalize(*b)
    lo, hi = segments(a, b)
    keep = covered(*a, lo)[0] & covered(*b, lo)[0]
    return normalize(lo[keep], hi[keep])


def clip(r, lo: int, hi: int):
    """The part of *r* inside [lo, hi)."""
    return intersect(r, of([lo], [hi]))


def round_out(r, bs: int, limit: int):
    """Each range widened to whole blocks of *bs* bytes, the last one cut at *limit*."""
    np = _np()
    s, e = r
    return normalize(s - s % bs, np.minimum(limit, -(-e // bs) * bs))


def round_in(r, bs: int):
    """The whole blocks of *bs* bytes inside each range."""
    s, e = r
    return normalize(-(-s // bs) * bs, e - e % bs)
