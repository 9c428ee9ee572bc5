"""Retention grids in zrepl's syntax, and the pure pruning decision (no I/O here).

A grid is a list of adjacent buckets, youngest first::

    1x1h(keep=all) | 24x1h | 14x1d | 8x1w

``N x DURATION (keep=K)`` repeats a bucket of length DURATION N times; each bucket keeps
its K *oldest* entries (default 1, ``all`` keeps every one). The first bucket's young edge
is "now", which zrepl takes as the youngest entry's time (so a site that stops receiving
does not age its history away); buckets contain (older edge, younger edge], and entries
older than the last bucket are not kept. Durations are a whole number of s, m, h, d or w.
zrepl refuses a grid whose bucket lengths shrink, unless every bucket before is keep=all;
so does this parser. (zrepl docs/configuration/prune.rst, pruning/retentiongrid.)

drsvc adds what a recovery point needs: the newest entry and pinned entries are always
kept, and pinned entries are outside the grid (they take no bucket's place).
"""
from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass

from .errors import RetentionGridInvalid

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_GRID = "1x1h(keep=all) | 24x1h | 14x1d | 8x1w"
NONE = "none"                  # keep only the newest point (and pinned ones)
MAX_BUCKETS = 10_000
_PART = re.compile(r"^\s*(\d+)\s*x\s*([^(\s]+)\s*(?:\((.*)\))?\s*$")
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_KEEP = re.compile(r"^\s*keep\s*=\s*(all|\d+)\s*$")


@dataclass(frozen=True)
class Bucket:
    length: int                  # seconds
    keep: int | None             # None: keep all


@dataclass(frozen=True)
class Grid:
    text: str
    buckets: tuple[Bucket, ...]

    @property
    def span(self) -> int:
        return sum(b.length for b in self.buckets)


def _duration(text: str, part: str) -> int:
    m = _DURATION.match(text)
    if m is None:
        raise RetentionGridInvalid(part=part, reason=f"duration {text!r} is not a whole number of s, m, h, d or w")
    secs = int(m.group(1)) * UNITS[m.group(2)]
    if secs <= 0:
        raise RetentionGridInvalid(part=part, reason="a bucket must be longer than zero")
    return secs


def _keep(options: str | None, part: str) -> int | None:
    if options is None:
        return 1
    m = _KEEP.match(options)
    if m is None:
        raise RetentionGridInvalid(part=part, reason=f"unknown option {options.strip()!r}; only keep=N or keep=all")
    if m.group(1) == "all":
        return None
    if int(m.group(1)) <= 0:
        raise RetentionGridInvalid(part=part, reason="keep must be at least 1, or all")
    return int(m.group(1))


def parse_grid(text: str) -> Grid:
    """A grid from its text; RetentionGridInvalid names the part that is wrong."""
    text = (text or "").strip()
    if text.lower() == NONE:
        return Grid(NONE, ())
    if not text:
        raise RetentionGridInvalid(part="", reason="the grid is empty")
    buckets: list[Bucket] = []
    for raw in text.split("|"):
        part = raw.strip()
        m = _PART.match(raw)
        if m is None:
            raise RetentionGridInvalid(part=part, reason="is not like 24x1h or 1x1h(keep=all)")
        count = int(m.group(1))
        if count <= 0:
            raise RetentionGridInvalid(part=part, reason="repeats zero times")
        if len(buckets) + count > MAX_BUCKETS:
            raise RetentionGridInvalid(part=part, reason=f"more than {MAX_BUCKETS} buckets in all")
        bucket = Bucket(_duration(m.group(2), part), _keep(m.group(3), part))
        if buckets and bucket.length < buckets[-1].length and any(b.keep is not None for b in buckets):
            raise RetentionGridInvalid(part=part, reason="is shorter than the bucket before it "
                                                         "(bucket lengths must not shrink)")
        buckets.extend([bucket] * count)
    return Grid(" | ".join(p.strip() for p in text.split("|")), tuple(buckets))


def check_grid(text: str) -> str:
    """The grid's normal text, or RetentionGridInvalid."""
    return parse_grid(text).text


def kept(grid: Grid, entries, now: float | None = None) -> set[int]:
    """Indexes of *entries* ((time, pinned) pairs) to keep.

    Pinned entries and the newest entry are always kept; the others go through the
    grid, whose first bucket ends at *now* (default: the newest entry's time, as zrepl)."""
    entries = list(entries)
    if not entries:
        return set()
    newest = max(range(len(entries)), key=lambda i: (entries[i][0], i))
    keep = {newest} | {i for i, (_, pinned) in enumerate(entries) if pinned}
    if now is None:
        now = entries[newest][0]
    ages = list(itertools.accumulate((b.length for b in grid.buckets), initial=0))   # bucket k: [ages[k], ages[k+1])
    members: list[list[int]] = [[] for _ in grid.buckets]
    for i, (t, pinned) in enumerate(entries):
        if pinned:
            continue
        if t > now:
            keep.add(i)              # in the future of "now": zrepl keeps it
            continue
        k = bisect.bisect_right(ages, now - t) - 1
        if k < len(members):
            members[k].append(i)
    for b, idx in zip(grid.buckets, members, strict=True):
        idx.sort(key=lambda i: (entries[i][0], i))
        keep.update(idx if b.keep is None else idx[:b.keep])
    return keep
