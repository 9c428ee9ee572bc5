"""A Demote's final sync goes ahead of scheduled syncs under the site's bandwidth cap.

Site a's config caps all its syncs together (``bwlimit``), in its Redis
(workers.bandwidth). Both tests run the real path: gRPC DemoteVolume at a's plugin,
the demote task on a's control worker, the syncs on its data worker (two processes),
sshd and receivers at b, loop-mounted XFS pools. A thread samples, every 50 ms, what b's
receivers have journaled per unit; the figures are ratios of those rates to the cap:

- scheduled syncs running (two) and queued (two): the Demote's final sync holds a
  priority lease, so it streams at the cap while the running ones wait, and it lands
  before any of them;
- the unit's own scheduled sync running when the Demote comes (it holds the unit's
  lock): the Demote waits for it rather than answering ABORTED, and the lease names the
  unit, so that sync takes the cap ahead of the others too.
"""
from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import redis

from drsvc_lab import Lab
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import journaled, wait_for, write_random
from tests.fixtures.sites import need_lab, started

# shares of a rate: run alone, after the parallel tests (pyproject's serial marker)
pytestmark = pytest.mark.serial

MiB = 1 << 20
CAP = 8 * MiB


@pytest.fixture(scope="module")
def capped():
    need_lab()
    lab = Lab(Path(tempfile.mkdtemp(prefix="drsvc-bw-"))).build()
    cfg = lab.sites["a"].config_path
    cfg.write_text(f"bwlimit = {CAP}\n" + cfg.read_text())      # top-level keys come before tables
    with started(lab) as lab:
        yield lab


class Journals:
    """What b's receivers have journaled per unit, sampled every 50 ms in a thread."""

    def __init__(self, pool, units):
        self.pool, self.units = pool, list(units)
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), {u: journaled(self.pool, u) for u in self.units}))
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join(5)

    def window(self, unit) -> tuple[float, float, int]:
        """First and last sample at which *unit*'s transaction held data, and the most it held."""
        seen = [(t, v[unit]) for t, v in self.samples if v[unit] > 0]
        assert seen, f"no transaction of {unit} was ever seen at the peer"
        return seen[0][0], seen[-1][0], max(v for _, v in seen)

    def growth(self, unit, start: float, end: float) -> int:
        """Bytes *unit*'s transaction gained between two instants (0 when it had none)."""
        inside = [v[unit] for t, v in self.samples if start <= t <= end]
        before = [v[unit] for t, v in self.samples if t <= start] or [0]
        return max(0, max(inside, default=0) - before[-1])


class _PriorityWatch:
    """When site a's priority lease on its bandwidth cap first existed (polled in its Redis)."""

    def __init__(self, site):
        self.r = redis.Redis(port=site.redis_port, socket_timeout=5)
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set() and self.at is None:
            if self.r.exists("drsvc:a:bw:site:priority"):
                self.at = time.monotonic()
            time.sleep(0.01)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        assert self.at is not None, "the Demote never held the priority lease"
        return self.at


def _generation(site, unit) -> int:
    st = find_state(site.pool, unit)
    return st.generation if st else 0


def _enable(A, site, name, *, mib: int, seed: int) -> str:
    vol = A.create_volume(name, size=(mib + 32) * MiB).volume_id
    if mib:
        write_random(site, vol, count=mib, size=MiB, seed=seed)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    return vol


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def test_the_final_sync_goes_ahead_of_running_and_queued_syncs(capped):
    A = capped.clients["a"]
    sa, sb = capped.sites["a"], capped.sites["b"]
    urgent = _enable(A, sa, "urgent", mib=0, seed=0)
    wait_for(lambda: _generation(sb, urgent) >= 1, 60, what="the urgent volume's initial sync")
    bulk = [_enable(A, sa, f"bulk-{i}", mib=24, seed=i) for i in range(4)]   # 2 run, 2 queue
    journals = Journals(sb.pool, [urgent, *bulk])
    try:
        running = wait_for(lambda: (r := [v for v in bulk if journaled(sb.pool, v)]) and len(r) >= 2 and r,
                           120, interval=0.05, what="two scheduled syncs to stream")
        write_random(sa, urgent, count=24, size=MiB, seed=99)
        A.retry("DemoteVolume", volume_id=urgent)
        landed = {v: _generation(sb, v) for v in bulk}
    finally:
        journals.stop()
    assert find_state(sa.pool, urgent).role == "secondary" and _generation(sb, urgent) >= 2
    # it went first: none of the running syncs, let alone the queued ones, landed before it
    assert not any(landed.values()), landed
    # its rate, as the sender timed its records going out (send_s: begin to the last record
    # handed to the channels; the peer's commit and fsync after it are not the cap's), and as
    # the peer saw it
    final = find_state(sa.pool, urgent).reports[-1]
    rate = final["bytes_on_wire"] / final["phases"]["send_s"] / CAP
    start, end, sent = journals.window(urgent)
    others = sum(journals.growth(v, start, end) for v in bulk)
    share = others / (others + sent)
    print(f"Demote's final sync: {final['bytes_on_wire'] / MiB:.1f} MiB at {rate:.3f} of the cap (stream "
          f"{final['phases']['send_s']:.2f}s; at the peer {sent / (end - start) / CAP:.3f} over {end - start:.2f}s); "
          f"the {len(running)} running syncs got {others / MiB:.2f} MiB meanwhile ({share:.3f} of what went); "
          f"load {_load()}")
    assert 0.85 <= rate <= 1.1
    assert share <= 0.1
    # and the scheduled syncs all finish afterwards
    wait_for(lambda: all(_generation(sb, v) >= 1 for v in bulk), 180, what="the scheduled syncs")


def test_a_demote_waits_for_its_units_running_sync_which_takes_the_cap(capped):
    A = capped.clients["a"]
    sa, sb = capped.sites["a"], capped.sites["b"]
    mine = _enable(A, sa, "mine", mib=24, seed=1)
    other = _enable(A, sa, "other", mib=24, seed=2)
    journals = Journals(sb.pool, [mine, other])
    try:
        wait_for(lambda: journaled(sb.pool, mine) and journaled(sb.pool, other), 120, interval=0.05,
                 what="both initial syncs to stream")
        held = _PriorityWatch(capped.sites["a"])
        A.retry("DemoteVolume", volume_id=mine)     # its lock is held by its running initial sync
        t1 = time.monotonic()
        # from when the Demote's task holds the priority (the RPC and the task's pickup before
        # it are not the cap's to share)
        t0 = held.stop()
        other_landed = _generation(sb, other)
    finally:
        journals.stop()
    st = find_state(sa.pool, mine)
    assert st.role == "secondary" and not st.diverged
    assert [r["steps"] for r in st.reports][-1] == ["sync"]      # the final sync ran after the initial one
    assert other_landed == 0, "the other unit's sync landed first"
    gained = journals.growth(mine, t0, t1)
    others = journals.growth(other, t0, t1)
    share = others / (others + gained)
    print(f"Demote waiting on its unit's sync: that sync gained {gained / MiB:.1f} MiB, the other unit "
          f"{others / MiB:.2f} MiB ({share:.3f}) in {t1 - t0:.2f}s; load {_load()}")
    assert share <= 0.15
    wait_for(lambda: _generation(sb, other) >= 1, 120, what="the other unit's sync")
