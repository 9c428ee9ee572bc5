"""Retention grids against zrepl's documented semantics.

zrepl docs/configuration/prune.rst ("Policy grid"): buckets are placed from the youngest
snapshot backwards, each bucket is left-inclusive (young edge) and right-exclusive (old
edge), each keeps its ``keep`` *oldest* snapshots, snapshots older than the last bucket are
destroyed. The table below is the docs' own example (grid ``1x1h(keep=all) | 2x2h | 1x3h``,
snapshots a..D, kept: a b c j p z), plus drsvc's two rules on top: the newest point and
pinned points are always kept, and pinned points take no bucket's place."""
from __future__ import annotations

import pytest

from drsvc.errors import RetentionGridInvalid
from drsvc.retention import DEFAULT_GRID, NONE, Bucket, kept, parse_grid

pytestmark = pytest.mark.fast
H = 3600.0


def _docs_example():
    """Snapshots a..D at ages (hours) that fall as the docs' figure draws them."""
    ages = {"a": 0.0, "b": 0.3, "c": 0.6,                                  # bucket 1 (keep=all)
            **{n: 1.1 + 0.3 * i for i, n in enumerate("defghij")},        # bucket 2: 1h..3h
            **{n: 3.1 + 0.35 * i for i, n in enumerate("klmnop")},        # bucket 3: 3h..5h
            **{n: 5.05 + 0.29 * i for i, n in enumerate("qrstuvwxyz")},   # bucket 4: 5h..8h
            **{n: 8.2 + 0.2 * i for i, n in enumerate("ABCD")}}           # older than the grid
    return ages


def _run(grid, ages, pinned=(), now=None):
    names = list(ages)
    t0 = 1_000_000.0
    entries = [(t0 - ages[n] * H, n in pinned) for n in names]
    return {names[i] for i in kept(parse_grid(grid), entries, None if now is None else t0 + now * H)}


TABLE = [
    # (grid, ages in hours, pinned, kept)
    ("1x1h(keep=all) | 2x2h | 1x3h", _docs_example(), (), set("abcjpz")),
    # the edge between buckets belongs to the older one ("falls into the right one")
    ("1x1h | 1x1h", {"n": 0.0, "e": 1.0, "o": 1.5}, (), {"n", "o"}),
    ("1x1h | 1x1h", {"n": 0.0, "e": 0.999, "o": 1.5}, (), {"n", "e", "o"}),
    # keep=N keeps the N oldest of a bucket; the newest point is kept whatever the grid says
    ("1x1h(keep=2)", {"n": 0.0, "x": 0.2, "y": 0.5, "z": 0.9}, (), {"n", "y", "z"}),
    # pinned points are outside the grid: they take no bucket's place and outlive it
    ("1x1h | 1x1h", {"n": 0.0, "p": 1.6, "o": 1.5, "old": 9.0}, ("p", "old"), {"n", "p", "o", "old"}),
    # 'none': only the newest and the pinned
    (NONE, {"n": 0.0, "x": 0.1, "p": 5.0}, ("p",), {"n", "p"}),
    # the newest point is 'now': a site that stopped receiving keeps its history
    ("1x1h | 1x1h", {"n": 100.0, "o": 101.5}, (), {"n", "o"}),
]


@pytest.mark.parametrize("grid,ages,pinned,want", TABLE)
def test_kept_set(grid, ages, pinned, want):
    assert _run(grid, ages, pinned) == want


def test_an_explicit_now_moves_every_bucket():
    # zrepl's FitEntries(now, ...): with now two hours later, the 1h-old point falls out
    assert _run("1x2h(keep=all)", {"n": 0.0, "o": 1.0}, now=1.5) == {"n"}


def test_the_compressed_grid_thins_a_point_a_second():
    g = parse_grid("1x10s(keep=all) | 24x10s | 14x60s")
    entries = [(float(t), False) for t in range(600)]           # ten minutes, one a second
    keep = kept(g, entries)
    ages = sorted(599 - entries[i][0] for i in keep)
    assert ages[:10] == list(range(10))                          # the last 10 s: all of them
    assert len([a for a in ages if 10 <= a < 250]) == 24         # one per 10 s bucket
    assert len([a for a in ages if a >= 250]) == 6                # 60 s buckets over the last 350 s
    assert len(keep) == 10 + 24 + 6


@pytest.mark.parametrize("text,buckets", [
    ("1x1h(keep=all) | 24x1h", [Bucket(3600, None)] + [Bucket(3600, 1)] * 24),
    (" 2 x 30m ( keep = 3 ) ", [Bucket(1800, 3)] * 2),
    ("1x1w", [Bucket(7 * 86400, 1)]),
    ("1x1h(keep=all) | 1x10m", [Bucket(3600, None), Bucket(600, 1)]),   # shrinking after keep=all only
])
def test_parse(text, buckets):
    assert list(parse_grid(text).buckets) == buckets


def test_default_grid_parses():
    assert len(parse_grid(DEFAULT_GRID).buckets) == 1 + 24 + 14 + 8


@pytest.mark.parametrize("text,part", [
    ("24x1h | x1d", "x1d"),
    ("0x1h", "0x1h"),
    ("1x1y", "1x1y"),
    ("1x0s", "1x0s"),
    ("1x1h(keep=0)", "1x1h(keep=0)"),
    ("1x1h(foo=1)", "1x1h(foo=1)"),
    ("1x1d | 1x1h", "1x1h"),
    ("1x1h |", ""),
    ("", ""),
])
def test_a_bad_grid_names_the_bad_part(text, part):
    with pytest.raises(RetentionGridInvalid) as e:
        parse_grid(text)
    assert e.value.fields["part"] == part
    assert repr(part) in e.value.message
