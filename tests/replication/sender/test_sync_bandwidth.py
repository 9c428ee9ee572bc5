"""The site's bandwidth cap in a real redis-server (workers.bandwidth.RedisBandwidth), over
real syncs: sender processes (as worker processes are) to real receivers (LocalPeer).

Each sender marks when its limiter lets each send through; the figures are ratios of
those marks' rates to the configured cap, never absolute times:

- 4 concurrent syncs in 4 processes hold the site's cap within 10%, in equal shares;
- a sync holding the priority lease (a Demote's final sync) gets the whole cap while
  the running syncs of other units wait, and finishes first;
- Redis killed mid-sync: the sync goes on at its process's share of the cap and is back on
  the shared bucket once Redis answers again; it neither hangs nor fails;
- the lease's arithmetic in Redis: grants follow the cap, others get none while a lease is
  held, and a holder that dies without letting go frees the cap one lease later.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from drsvc.config import parse
from drsvc_lab import free_port, spawn_redis
from drsvc.replication import sync_unit
from drsvc.transport.bandwidth import TokenBucket
from drsvc.transport.local import LocalPeer
from tests.dr.helpers import journaled
from tests.ops.conftest import redis_port  # noqa: F401 - the fixture
from workers.bandwidth import POLL, PriorityLease, RedisBandwidth, RedisBucket, client, grant_size

from ..conftest import make_image, new_sites, same_images

# shares of a rate: run alone, after the parallel tests (pyproject's serial marker)
pytestmark = pytest.mark.serial

MiB = 1 << 20
CAP = 8 * MiB

SENDER = r"""
import contextlib, json, sys, time
import redis
from drsvc.config import parse
from drsvc.replication import sync_unit
from drsvc.transport.local import LocalPeer
from workers.bandwidth import RedisBandwidth, client

a, b, unit, port, cap, out, priority, own = sys.argv[1:]
cfg = parse({"site": "a", "pool": a, "bwlimit": int(cap) if cap.isdigit() else cap,
             "peers": {"b": {"transport": "local", "pool": b}}})
site = RedisBandwidth(client(f"redis://127.0.0.1:{port}/0"), cfg.site, cfg.cap_schedules, shares=8)
marks = []


class Marked:
    # the limiter the worker would build, noting when each send was let through
    def __init__(self, inner):
        self.inner = inner

    def take(self, n):
        self.inner.take(n)
        marks.append((time.time(), n))


print("ready", flush=True)
sys.stdin.readline()
with site.priority(unit, "b") if priority == "1" else contextlib.nullcontext():
    r = sync_unit(a, unit, [unit], LocalPeer(b), bandwidth=Marked(site.limiter(unit, "b")),
                  bwlimit=int(own) or None)
with open(out, "w") as f:
    json.dump({"marks": marks, "bytes_on_wire": r.bytes_on_wire, "done": time.time()}, f)
"""


class Sender:
    """One sync in a process of its own, started when told to."""

    def __init__(self, a: Path, b: Path, unit: str, port: int, out: Path, *, priority: bool = False,
                 own: int = 0, cap: str = str(CAP)):
        self.unit, self.out = unit, out
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER, str(a), str(b), unit, str(port), cap,
                                      str(out), "1" if priority else "0", str(own)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline() == b"ready\n"      # imports done

    def go(self) -> None:
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        assert self.proc.wait(timeout=300) == 0
        return json.loads(self.out.read_text())


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _kill(senders) -> None:
    for s in senders:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def _bytes_between(marks, start: float, end: float) -> int:
    return sum(n for t, n in marks if start < t <= end)


def _volumes(a: Path, names, mib: int) -> None:
    for v in names:
        make_image(a / "images" / f"{v}.img", (mib + 8) * MiB, [(j * MiB, os.urandom(MiB)) for j in range(mib)])


def test_four_concurrent_syncs_in_four_processes_hold_the_site_cap(xfs_mod, tmp_path, redis_port):  # noqa: F811
    a, b = new_sites(xfs_mod)
    vols = [f"v{i}" for i in range(4)]
    _volumes(a, vols, 16)                  # 64 MiB in all: 8 s at the cap, against 0.1 s of burst
    senders = [Sender(a, b, v, redis_port, tmp_path / f"{v}.json") for v in vols]
    try:
        for s in senders:
            s.go()
        results = [s.result() for s in senders]
    finally:
        _kill(senders)
    same_images(a, b, vols)
    marks = [r["marks"] for r in results]
    for r in results:       # every byte went through the limiter (and the few of the requests around it)
        assert 0 <= sum(n for _, n in r["marks"]) - r["bytes_on_wire"] < 4096
    # the window in which all four were sending
    start, end = max(m[0][0] for m in marks), min(m[-1][0] for m in marks)
    total = sum(r["bytes_on_wire"] for r in results)
    shares = [_bytes_between(m, start, end) for m in marks]
    assert sum(shares) >= total / 2, "the four syncs overlapped too little to measure the cap"
    ratio = sum(shares) / (end - start) / CAP
    first, last = min(m[0][0] for m in marks), max(m[-1][0] for m in marks)
    overall = total / (last - first) / CAP
    print(f"4 processes, cap {CAP / MiB:.0f} MiB/s: all four sending for {end - start:.2f}s, aggregate/cap "
          f"{ratio:.3f}; first to last send {overall:.3f}; shares {[round(x / sum(shares), 3) for x in shares]}; "
          f"load {load()}")
    assert 0.9 <= ratio <= 1.1
    # served in the order asked: no sync starves, none takes much more than its quarter
    assert all(0.15 <= x / sum(shares) <= 0.35 for x in shares), shares


def test_a_scheduled_cap_changes_at_its_boundary_mid_sync(xfs_mod, tmp_path, redis_port):  # noqa: F811
    """bwlimit by the hour: a sync running when the schedule's window ends goes on at the next
    entry's rate from the boundary on. The window here ends a few seconds after the sync starts
    (the schedule is read in UTC, the site's default zone)."""
    a, b = new_sites(xfs_mod)
    _volumes(a, ["sched"], 48)           # ~3 s at half the cap, then ~4 s at the cap
    now = time.time()
    if now % 86400 > 86400 - 30:          # a window 00:00-boundary must not wrap past midnight
        time.sleep(86400 - now % 86400 + 1)
    boundary = int(time.time()) + 5
    end = time.strftime("%H:%M:%S", time.gmtime(boundary))
    sender = Sender(a, b, "sched", redis_port, tmp_path / "sched.json", cap=f"{CAP // 2} 00:00-{end}, {CAP}")
    try:
        sender.go()
        r = sender.result()
    finally:
        _kill([sender])
    same_images(a, b, ["sched"])
    marks = r["marks"]
    first, last = marks[0][0], marks[-1][0]
    assert first < boundary - 1.5 and last > boundary + 1.5, (first, boundary, last)
    before = _bytes_between(marks, first, boundary) / (boundary - first) / (CAP / 2)
    settle = boundary + 0.2               # a grant asked before the boundary is served at the old rate
    after = _bytes_between(marks, settle, last) / (last - settle) / CAP
    print(f"scheduled cap: {before:.3f} of the first entry's rate for {boundary - first:.2f}s, then {after:.3f} of "
          f"the default's for {last - settle:.2f}s; load {load()}")
    assert 0.85 <= before <= 1.1
    assert 0.85 <= after <= 1.1


def _race(xfs_mod, tmp_path, port, *, own: int = 0) -> tuple[dict, list, float, float]:
    """Three syncs of other units streaming, then the priority one (16 MiB) starts; returns the
    results, the other units, and the window of the priority sync's sends."""
    a, b = new_sites(xfs_mod)
    bulk = [f"bulk{i}" for i in range(3)]
    _volumes(a, bulk, 24)
    _volumes(a, ["final"], 16)
    senders = [Sender(a, b, v, port, tmp_path / f"{v}.json") for v in bulk]
    final = Sender(a, b, "final", port, tmp_path / "final.json", priority=True, own=own)
    try:
        for s in senders:
            s.go()
        deadline = time.monotonic() + 120
        while not all(journaled(b, v) for v in bulk):              # all three are sending
            assert time.monotonic() < deadline and all(s.proc.poll() is None for s in senders)
            time.sleep(0.05)
        final.go()
        results = {s.unit: s.result() for s in [*senders, final]}
    finally:
        _kill([*senders, final])
    same_images(a, b, [*bulk, "final"])
    fm = results["final"]["marks"]
    return results, bulk, fm[0][0], fm[-1][0]


def test_the_priority_sync_takes_the_cap_while_the_others_wait(xfs_mod, tmp_path, redis_port):  # noqa: F811
    results, bulk, start, end = _race(xfs_mod, tmp_path, redis_port)
    rate = results["final"]["bytes_on_wire"] / (end - start) / CAP
    others = sum(_bytes_between(results[v]["marks"], start, end) for v in bulk)
    share = others / (others + results["final"]["bytes_on_wire"])
    print(f"priority sync: {rate:.3f} of the cap over {end - start:.2f}s; the 3 others sent {others / MiB:.2f} MiB "
          f"meanwhile ({share:.3f} of what went); load {load()}")
    assert 0.85 <= rate <= 1.1
    assert share <= 0.1
    # it finished first, and the others went on to the end afterwards
    assert all(results[v]["marks"][-1][0] > end for v in bulk)


def test_a_priority_sync_slower_than_the_cap_leaves_the_rest_to_the_others(xfs_mod, tmp_path,
                                                                           redis_port):  # noqa: F811
    """Its unit's own limit holds the priority sync to a quarter of the cap: the link does not
    idle, the others share the rest, and the priority sync keeps its own rate."""
    own = CAP // 4
    results, bulk, start, end = _race(xfs_mod, tmp_path, redis_port, own=own)
    rate = results["final"]["bytes_on_wire"] / (end - start) / own
    others = sum(_bytes_between(results[v]["marks"], start, end) for v in bulk)
    total = (others + results["final"]["bytes_on_wire"]) / (end - start) / CAP
    print(f"priority sync at its own limit: {rate:.3f} of it; all four together {total:.3f} of the cap over "
          f"{end - start:.2f}s; load {load()}")
    assert 0.85 <= rate <= 1.1
    assert 0.8 <= total <= 1.1


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server this test may kill and start again on the same port."""
    port = free_port()
    procs = []

    def start():
        procs.append(spawn_redis(tmp_path / "redis", port, persist=False))

    def stop():
        procs[-1].kill()
        procs[-1].wait()
    start()
    try:
        yield port, start, stop
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_redis_gone_mid_sync_the_sync_goes_on_at_its_share(xfs_mod, own_redis, caplog):
    port, start_redis, stop_redis = own_redis
    a, b = new_sites(xfs_mod)
    _volumes(a, ["v"], 40)
    cfg = parse({"site": "a", "pool": str(a), "bwlimit": CAP, "peers": {"b": {"transport": "local", "pool": str(b)}}})
    r = client(f"redis://127.0.0.1:{port}/0")
    site = RedisBandwidth(r, "a", cfg.bandwidth_caps, shares=2)          # alone: half the cap
    limiter = site.limiter("v", "b")
    marks = []

    class Marked:
        def take(self, n):
            limiter.take(n)
            marks.append((time.monotonic(), n))

    out = {}
    caplog.set_level(logging.WARNING, logger="workers.bandwidth")
    t = threading.Thread(target=lambda: out.update(report=sync_unit(a, "v", ["v"], LocalPeer(b),
                                                                     bandwidth=Marked())))
    t.start()
    deadline = time.monotonic() + 120
    while sum(n for _, n in marks) < 4 * MiB:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    stop_redis()
    killed = time.monotonic()
    time.sleep(1.0)
    start_redis()                  # back, empty: the bucket starts afresh
    t.join(300)
    assert not t.is_alive() and "report" in out
    same_images(a, b, ["v"])
    # the first failed call falls back at once; the process's bucket serves REDIS_RETRY (5 s)
    first_local = next(tm for tm, _ in marks if tm > killed)
    local = _bytes_between(marks, first_local + 0.5, first_local + 4.5) / 4.0 / (CAP / 2)
    back = [tm for tm, _ in marks if tm > first_local + 5.5]
    assert back, "the sync ended before it could be back on the shared cap"
    shared = _bytes_between(marks, back[0], marks[-1][0]) / (marks[-1][0] - back[0]) / CAP
    print(f"Redis away: {local:.3f} of the process's share (cap / 2); back on the shared bucket: {shared:.3f} "
          f"of the cap; load {load()}")
    assert 0.9 <= local <= 1.1
    assert 0.8 <= shared <= 1.1
    assert r.exists("drsvc:a:bw:site")                                   # its grants come from Redis again
    said = [rec.getMessage() for rec in caplog.records]
    assert any("does not answer" in m for m in said) and any("answers again" in m for m in said), said


def test_grants_leases_and_a_lapsed_holder(own_redis):
    port, _, _ = own_redis
    r = redis.Redis(port=port)
    key = "drsvc:a:bw:site"
    waits = []

    def bucket(unit):
        return RedisBucket(r, key, CAP, unit_id=unit, fallback=TokenBucket(CAP), sleep=waits.append)
    other, mine = bucket("other"), bucket("mine")
    grant = grant_size(CAP)
    # the cap's arithmetic: grants asked back to back are scheduled at the cap, each told to
    # wait until its turn; the last of 40 MiB waits for all before it, less the burst
    t0 = time.monotonic()
    for _ in range(40 * MiB // grant):
        assert other._ask(grant) == grant
    elapsed = time.monotonic() - t0
    asked = 40 * MiB // grant * grant
    assert waits == sorted(waits)
    assert waits[-1] == pytest.approx((asked - grant - other.burst) / CAP - elapsed, abs=0.05)
    r.delete(key)

    with PriorityLease(r, [f"{key}:priority"], "mine"):
        waits.clear()
        # the priority unit takes nothing yet: the others may use the idle cap, one grant ahead
        assert other._ask(grant) == grant and waits == []
        # no grant: ask again once that one has gone
        assert other._ask(grant) == 0 and waits == [pytest.approx(grant / CAP, abs=0.005)]
        assert mine._ask(grant) == grant and len(waits) == 1                   # never waits for theirs
        for _ in range(20):                              # the priority unit keeps the schedule ahead
            assert mine._ask(grant) == grant
        assert other._ask(grant) == 0 and waits[-1] == POLL                  # so the others get nothing
    assert other._ask(grant) == grant                    # let go: served again, in turn

    held = PriorityLease(r, [f"{key}:priority"], "mine", ttl=1.0).__enter__()
    held._stop.set()                                    # its worker dies: no renewal, no release
    held._thread.join(5)
    for _ in range(50):                                 # a second of the cap reserved ahead
        mine._ask(grant)
    assert other._ask(grant) == 0
    time.sleep(1.2)
    assert other._ask(grant) == grant                   # lapsed one lease later


def test_no_cap_no_redis(tmp_path):
    """bwlimit 0: no bucket, no lease, no Redis call (this client's Redis does not exist)."""
    site = RedisBandwidth(redis.Redis(port=free_port(), socket_connect_timeout=0.2), "a", lambda peer: {}, shares=2)
    assert site.limiter("v", "b") is None
    with site.priority("v", "b"):
        pass
