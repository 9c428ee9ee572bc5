"""The scheduler at scale: units spread over their interval, and a leader change
brings neither a burst nor a gap.

Real parts: a redis-server of its own, the real APScheduler with its SQLite job store in
the pool, the real leader lease, and Celery's Redis transport carrying the queued syncs
(no worker consumes them, so the test reads when each arrived from the queue itself).
"""
from __future__ import annotations

import base64
import json
import threading
import time

import pytest
import redis

from drsvc import runner
from drsvc.config import load
from drsvc import store
from drsvc.replication.control import health
from drsvc.replication.common import unit_state
from drsvc.replication.control.relationship import Control, save_control
from drsvc.schedule import phase
from drsvc_lab import wait_until
from workers.scheduler import SiteScheduler

INTERVAL = 30
UNITS = [f"vol-{i:024x}" for i in range(1, 61)]


@pytest.fixture
def site(tmp_path, redis_port):
    pool = tmp_path / "pool"
    pool.mkdir()
    for u in UNITS:           # units enabled here as primary, as EnableVolumeReplication leaves them
        unit_state.ensure_unit(pool, u, [u], kind="volume", role="primary", peer="b")
        save_control(pool, Control(unit_id=u, kind="volume", members=[u], peer="b", interval=INTERVAL,
                                   enabled_at=time.time()))
    cfg_path = tmp_path / "site.toml"
    cfg_path.write_text(f'site = "t"\npool = "{pool}"\nredis_url = "redis://127.0.0.1:{redis_port}/0"\n')
    return load(cfg_path), redis.Redis(port=redis_port)


def _run(cfg):
    s = SiteScheduler(cfg, reconcile_every=0.5)
    t = threading.Thread(target=s.run, daemon=True)
    t.start()
    return s, t


def _queued(r, queue) -> list[dict]:
    """The drsvc.sync tasks waiting on *queue*, oldest first (kombu's Redis list, LPUSHed)."""
    out = []
    for raw in reversed(r.lrange(queue, 0, -1)):
        msg = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(msg["body"]))
        out.append({"unit": args[0], **kwargs})
    return out


def test_units_spread_and_takeover_replays_missed_runs_at_pace(site):
    cfg, r = site
    s1, t1 = _run(cfg)
    try:
        wait_until(lambda: len((store.read_json(health.next_runs_path(cfg.pool)) or {}).get("next", {}))
                   >= len(UNITS), 30, "the leader to publish its next runs", interval=0.2)
        runs = store.read_json(health.next_runs_path(cfg.pool))["next"]
        # each unit fires at its own phase of the interval: no two-second window holds more than a few
        for u in UNITS:
            assert (runs[u] - phase(u, INTERVAL)) % INTERVAL == pytest.approx(0, abs=1e-3)
        offsets = sorted(runs[u] % INTERVAL for u in UNITS)
        busiest = max(sum(1 for o in offsets if a <= o < a + 2) for a in offsets)
        assert busiest <= 12, offsets          # all at once would be 60; uniform is 4
    finally:
        s1.stop.set()
        t1.join(10)
    # the leader is gone for a while: the runs due meanwhile are missed
    r.delete(cfg.queue)
    gone = time.time()

    def missed():
        return [u for u in UNITS if gone <= runs[u] < time.time()]
    due = wait_until(lambda: len(m := missed()) >= 10 and m, 3 * INTERVAL, "ten runs due while no leader is up",
                     interval=0.1)
    assert len(due) >= 3, "the gap missed too few runs to tell a burst from a replay"
    s2, t2 = _run(cfg)
    try:
        wait_until(lambda: r.exists(f"drsvc:{cfg.site}:scheduler-leader"), 10, "the new leader", interval=0.05)
        # the replay has begun: its first missed run is queued
        wait_until(lambda: {m["unit"] for m in _queued(r, cfg.queue)} & set(due), 10, "the first replayed run",
                   interval=0.05)
        early = {m["unit"] for m in _queued(r, cfg.queue)}
        # a burst would queue every missed run at once; a replay queues them as they were due
        assert len(early & set(due)) < len(due), (len(early & set(due)), len(due))
        def all_replayed():
            q = _queued(r, cfg.queue)
            return set(due) <= {m["unit"] for m in q} and q
        queued = wait_until(all_replayed, INTERVAL, "every missed run to be replayed (else: a gap)", interval=0.2)
        late = {m["unit"] for m in queued}
        assert set(due) <= late, "a missed run was dropped (a gap)"
        for m in queued:                # each task carries the slot it was due at
            assert m["trigger"] == "schedule"
            assert (m["scheduled_at"] - phase(m["unit"], INTERVAL)) % INTERVAL == pytest.approx(0, abs=1e-2) \
                or (m["scheduled_at"] - phase(m["unit"], INTERVAL)) % INTERVAL == pytest.approx(INTERVAL, abs=1e-2)
    finally:
        s2.stop.set()
        t2.join(10)


def test_standby_takes_over_within_a_lease_after_kill_9(site, tmp_path):
    """Two schedulers of one site (real processes, `python -m workers.scheduler`): the
    leader is killed with SIGKILL, so its lease is not given back; the standby holds it
    within one lease period (plus one reconcile tick) and goes on queueing syncs."""
    import os
    import signal
    import sys

    from workers.scheduler import LEASE_S
    cfg, r = site
    key = f"drsvc:{cfg.site}:scheduler-leader"
    procs = []
    try:
        for i in range(2):
            log = open(tmp_path / f"sched{i}.log", "wb")  # noqa: SIM115 - the child keeps it
            procs.append(runner.spawn([sys.executable, "-m", "workers.scheduler", "--config", str(cfg.path)],
                                      stdout=log, stderr=log))
        wait_until(lambda: r.get(key), 30, "a scheduler to take the lease", interval=0.1)
        leader_pid = int(r.get(key).decode().split(":")[1])
        assert leader_pid in {p.pid for p in procs}
        os.kill(leader_pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: (h := r.get(key)) and int(h.decode().split(":")[1]) != leader_pid, LEASE_S + 10,
                   "the standby to take over", interval=0.1)
        took = time.monotonic() - killed
        print(f"standby took over {took:.1f}s after the leader's SIGKILL (lease {LEASE_S}s)")
        r.delete(cfg.queue)
        r.delete(*r.keys(f"drsvc:{cfg.site}:sync-queued:*") or ["none"])
        wait_until(lambda: r.llen(cfg.queue), INTERVAL + 10, "the new leader to queue a sync", interval=0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
