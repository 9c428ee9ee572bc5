"""What every bench case shares: data making, rsync runs, timing statistics, the run loop.

A case is measured by :func:`measure`: per run it changes the data, times the
floor (the changed blocks read cold, in offset order), then drsvc, then rsync,
each after the caches are made cold again (unless --warm), and keeps every
figure. :class:`CaseResult` turns the runs into the JSON shape of the bench.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from drsvc import runner

from .site import rsync_ssh
from .texts import channel_text, extents_text, link_text, wan_ceilings_text

MiB, GiB = 1 << 20, 1 << 30
BS = 4096
RSYNC_DELTA = ["--inplace", "--no-whole-file", "--ignore-times"]


def write_random(path: Path, size: int, rnd: random.Random) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(4 * MiB, left)
            f.write(rnd.randbytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())   # a volume's data is on disk, not dirty in the cache


def rewrite_blocks(path: Path, fraction: float, rnd: random.Random, *, count: int | None = None) -> list[int]:
    """Rewrite *fraction* (or *count*) of the 4 KiB blocks of *path* at random places,
    with new random data, then fsync; returns the offsets written."""
    size = path.stat().st_size
    n = count if count is not None else int(size // BS * fraction)
    blocks = rnd.sample(range(size // BS), n)
    fd = os.open(path, os.O_RDWR)
    try:
        for b in blocks:
            os.pwrite(fd, rnd.randbytes(BS), b * BS)
        os.fsync(fd)
    finally:
        os.close(fd)
    return [b * BS for b in blocks]


def same_content(*paths) -> bool:
    """Whether the files hold the same bytes (sizes included)."""
    sizes = {os.stat(p).st_size for p in paths}
    if len(sizes) != 1:
        return False
    with contextlib.ExitStack() as stack:
        fs = [stack.enter_context(open(p, "rb")) for p in paths]
        while True:
            chunks = [f.read(8 * MiB) for f in fs]
            if any(c != chunks[0] for c in chunks[1:]):
                return False
            if not chunks[0]:
                return True


def extent_count(path: Path) -> int:
    out = runner.run(["filefrag", path]).stdout
    m = re.search(r"(\d+) extents? found", out)
    return int(m.group(1)) if m else -1


def run_rsync(site, src: Path, dest: Path, flags) -> tuple[float, int]:
    """One rsync over OpenSSH to the loopback sshd; (wall seconds, bytes both ways)."""
    t = time.monotonic()
    res = runner.run(["rsync", *flags, "--stats", "-e", rsync_ssh(site), src, f"root@127.0.0.1:{dest}"],
                     timeout=1200)
    wall = time.monotonic() - t
    sent = int(re.search(r"Total bytes sent: ([\d,]+)", res.stdout).group(1).replace(",", ""))
    recv = int(re.search(r"Total bytes received: ([\d,]+)", res.stdout).group(1).replace(",", ""))
    return wall, sent + recv


def stats(xs) -> dict | None:
    """best / median / runs (in run order) of a list of seconds (None when empty)."""
    if not xs:
        return None
    xs = [float(x) for x in xs]
    return {"best": round(min(xs), 4), "median": round(statistics.median(xs), 4),
            "runs": [round(x, 4) for x in xs]}


def phase_medians(phases: list[dict]) -> dict:
    keys = sorted({k for p in phases for k in p})
    return {k: round(statistics.median(p.get(k, 0.0) for p in phases), 4) for k in keys}


@dataclass
class Run:
    """What one run of a case changes: its size, and the ranges the floor reads."""
    changed_bytes: int
    floor_files: list = field(default_factory=list)    # [(path, [(offset, length), ...])]


@dataclass
class CaseResult:
    name: str
    cold: bool
    changed: list = field(default_factory=list)
    drsvc: list = field(default_factory=list)
    drsvc_wire: list = field(default_factory=list)
    phases: list = field(default_factory=list)
    rsync: list = field(default_factory=list)
    rsync_wire: list = field(default_factory=list)
    floor: list = field(default_factory=list)
    floor_parts: list = field(default_factory=list)     # per run: exact_s (no readahead), readahead_s
    ranges_cloned: list = field(default_factory=list)   # per run: the overlay capture's FICLONERANGE calls
    rss: dict = field(default_factory=lambda: {"sender": 0, "receiver": 0})
    verified: bool | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"name": self.name, "changed_bytes": max(self.changed) if self.changed else 0,
             "drsvc_s": stats(self.drsvc), "drsvc_wire_bytes": max(self.drsvc_wire) if self.drsvc_wire else 0,
             "rsync_s": stats(self.rsync), "rsync_wire_bytes": max(self.rsync_wire) if self.rsync_wire else None,
             "floor_s": stats(self.floor) if self.cold else None,
             "floor_exact_s": stats([p["exact_s"] for p in self.floor_parts]) if self.cold else None,
             "floor_readahead_s": stats([p["readahead_s"] for p in self.floor_parts]) if self.cold else None,
             "ratio": (round(statistics.median(self.rsync) / statistics.median(self.drsvc), 2)
                       if self.rsync and self.drsvc else None),
             "drsvc_mb_s": (round(statistics.median(self.changed) / statistics.median(self.drsvc) / 1e6, 1)
                            if self.drsvc else None),
             "drsvc_phases": self.phases, "drsvc_phases_median": phase_medians(self.phases),
             "peak_rss_bytes": dict(self.rss), "replica_matches_source": self.verified}
        d.update(self.extra)
        return d

    def print(self) -> None:
        d = self.to_dict()

        def med(k):
            return d[k]["median"] if d[k] else float("nan")
        print(f"{self.name:8} changed {d['changed_bytes'] / MiB:8.2f} MiB | drsvc median {med('drsvc_s'):7.3f} s "
              f"(best {d['drsvc_s']['best'] if d['drsvc_s'] else float('nan'):.3f}) "
              f"{d['drsvc_wire_bytes'] / MiB:8.2f} MiB wire | rsync median {med('rsync_s'):7.3f} s "
              f"{(d['rsync_wire_bytes'] or 0) / MiB:8.2f} MiB wire | ratio {d['ratio']} "
              f"| floor median {med('floor_s'):.3f} s", flush=True)
        for i, ph in enumerate(self.phases):
            fl = (f" floor {self.floor[i]:.3f} s (exact {self.floor_parts[i]['exact_s']:.3f}, readahead "
                  f"{self.floor_parts[i]['readahead_s']:.3f})" if i < len(self.floor) else "")
            print(f"           run {i}: drsvc {self.drsvc[i]:.3f} s{fl}  phases {ph}", flush=True)
        print(f"           phase medians {d['drsvc_phases_median']}; peak RSS sender "
              f"{self.rss['sender'] / MiB:.1f} MiB, receiver {self.rss['receiver'] / MiB:.1f} MiB; "
              f"replica matches source: {self.verified}", flush=True)
        if rt := self.extra.get("round_trips"):
            print(f"           round trips per sync (replies waited for, the sync report's): {rt}", flush=True)
        if wm := self.extra.get("warm"):
            print(f"           session: warm as a worker's (remote.warm at its start, {wm['s']:.2f} s: "
                  f"receivers per connection {wm['receivers']}, rtt {wm['rtt_s'] or 0:.3f} s)", flush=True)
        if ch := self.extra.get("channel"):
            print(f"           ceiling: {channel_text(ch)} (medians of {len(ch['runs']['drsvc'])})", flush=True)
        if wc := self.extra.get("wan_ceilings"):
            print(f"           ceiling: {wan_ceilings_text(wc)} (medians of {len(wc['runs']['emulator'])})",
                  flush=True)
        if ec := self.extra.get("extent_costs"):
            print(f"           kernel: {extents_text(ec)}", flush=True)
        if lk := self.extra.get("link"):
            print(f"           {lk['spec']}: {link_text(lk)}", flush=True)


def measure(res: CaseResult, repeat: int, *, change: Callable[[int], Run], drsvc: Callable[[int], dict],
            rsync: Callable[[int], tuple[float, int]] | None, make_cold: Callable[[], None]) -> CaseResult:
    """Run a case *repeat* times: change the data, then the floor (cold runs only), then
    drsvc, then rsync, each from cold caches (make_cold does nothing with --warm).
    drsvc(i) returns {"wall_s", "report"} of one sync."""
    from .floor import floor_s
    for i in range(repeat):
        run = change(i)
        res.changed.append(run.changed_bytes)
        if res.cold:
            fl = floor_s(run.floor_files, make_cold)
            res.floor.append(fl["floor_s"])
            res.floor_parts.append(fl)
        make_cold()
        d = drsvc(i)
        res.drsvc.append(d["wall_s"])
        res.drsvc_wire.append(d["report"]["bytes_on_wire"])
        res.phases.append(d["report"]["phases"])
        res.ranges_cloned.append(d["report"].get("ranges_cloned", 0))
        res.extra.setdefault("round_trips", []).append(d["report"].get("round_trips"))
        if rsync is not None:
            make_cold()
            t, w = rsync(i)
            res.rsync.append(t)
            res.rsync_wire.append(w)
    return res
