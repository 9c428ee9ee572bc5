"""The scheduler at scale: units spread over their interval, a leader change brings
neither a burst nor a gap, and a tick's work follows the due and the changed units, not
the scheduled ones.

Real parts: a redis-server of its own, the real scheduler with its due-run table in the
pool, the real leader lease, and Celery's Redis transport carrying the queued syncs
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
from workers.scheduler import SiteScheduler, enqueue_sync

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


# -- a tick's work follows the due units ----------------------------------------------------
def _pool_of(tmp_path, redis_port, n: int, *, interval: int, start_time: float | None):
    pool = tmp_path / f"pool-{n}"
    pool.mkdir()
    for i in range(n):
        u = f"vol-{i:024x}"
        unit_state.ensure_unit(pool, u, [u], kind="volume", role="primary", peer="b")
        save_control(pool, Control(unit_id=u, kind="volume", members=[u], peer="b", interval=interval,
                                   start_time=start_time, enabled_at=time.time()))
    cfg_path = tmp_path / f"site-{n}.toml"
    cfg_path.write_text(f'site = "t{n}"\npool = "{pool}"\nredis_url = "redis://127.0.0.1:{redis_port}/0"\n')
    return load(cfg_path)


def _redis_calls(r) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")


def _leader(cfg) -> SiteScheduler:
    s = SiteScheduler(cfg)
    assert s._lead()
    s._start()
    return s


def _idle_ticks(s, r, ticks: int = 20) -> tuple[int, int, int]:
    """(units read, heap entries popped, Redis commands) over *ticks* ticks with no run due."""
    read0, pops0, calls0 = s.work.units_read, s.index.pops, _redis_calls(r)
    for _ in range(ticks):
        s.tick()
    return s.work.units_read - read0, s.index.pops - pops0, _redis_calls(r) - calls0


def test_an_idle_tick_costs_the_same_at_1000_units_as_at_10(tmp_path, redis_port):
    """Work counted, not timed: with every unit's slot half an hour away, a tick at 1,000
    scheduled units reads no unit, pops nothing off the due index and sends Redis nothing,
    exactly as at 10. Only taking the lead reads them all (once)."""
    r = redis.Redis(port=redis_port)
    later = time.time() + 1800
    counts = {}
    for n in (10, 1000):
        s = _leader(_pool_of(tmp_path, redis_port, n, interval=3600, start_time=later))
        try:
            assert s.work.units_read == n and len(s.index) == n
            counts[n] = _idle_ticks(s, r)
        finally:
            s._resign()
    assert counts[10] == counts[1000] == (0, 0, 0), counts


def test_a_tick_reads_only_the_units_that_changed(tmp_path, redis_port):
    """Among 1,000 idle units: one enabled, one demoted, one given a new interval and one
    disabled are each read once, on the next tick, and nothing else is; the due index and
    the published next runs follow them. Then five units whose slot comes: the tick that
    queues them pops five entries (plus stale ones of the units rescheduled), not 1,000."""
    from drsvc.replication.control.relationship import remove_control, update_control
    r = redis.Redis(port=redis_port)
    later = time.time() + 1800
    cfg = _pool_of(tmp_path, redis_port, 1000, interval=3600, start_time=later)
    pool = cfg.pool
    s = _leader(cfg)
    try:
        units = sorted(s.index.runs)
        new = f"vol-{'f' * 24}"
        unit_state.ensure_unit(pool, new, [new], kind="volume", role="primary", peer="b")
        save_control(pool, Control(unit_id=new, kind="volume", members=[new], peer="b", interval=600,
                                   start_time=later, enabled_at=time.time()))
        unit_state.mark_demoted(pool, units[1])
        update_control(pool, units[2], lambda c: setattr(c, "interval", 7200))
        remove_control(pool, units[3])
        update_control(pool, units[4], lambda c: setattr(c, "last_sync_time", time.time()))  # a sync's outcome
        read0 = s.work.units_read
        s.tick()
        assert s.work.units_read - read0 == 4
        assert new in s.index.runs and s.index.runs[new].interval == 600
        assert units[1] not in s.index.runs and units[3] not in s.index.runs
        assert s.index.runs[units[2]].interval == 7200
        published = store.read_json(health.next_runs_path(pool))["next"]
        assert set(published) == set(s.index.runs) and len(published) == 1000 - 2 + 1
        assert _idle_ticks(s, r) == (0, 0, 0)
        # five units due in a moment (their start time moves their phase)
        soon = time.time() + 1.5
        for u in units[10:15]:
            update_control(pool, u, lambda c: setattr(c, "start_time", soon))
        s.tick()
        enqueue_sync(str(cfg.path), f"vol-{'e' * 24}", 3600)    # the app's connection, made once per process
        r.delete(cfg.queue)
        pops0, calls0 = s.index.pops, _redis_calls(r)
        wait_until(lambda: time.time() > soon + 0.05, 5, "the slot", interval=0.05)
        s.tick()
        assert s.work.per_tick[-1][2] == 5                  # fired
        assert s.index.pops - pops0 <= 5 + 5                # the five, and their stale entries
        # each queued sync: its marker (SET NX), the message (LPUSH) and its sent event
        calls = _redis_calls(r) - calls0
        assert calls <= 5 * 3, calls
        queued = _queued(r, cfg.queue)
        assert sorted(m["unit"] for m in queued) == units[10:15]
    finally:
        s._resign()


def test_a_sync_the_peer_asked_for_now_fires_on_the_next_tick_once(tmp_path, redis_port):
    """A copy waiting on its primary's sync (a resync, a repair) asks for it now
    (``schedule_changes.ask_soon``, as the receiver's ``soon`` verb does): the next tick
    queues that unit's sync, and only it, and the unit's next run is its own slot again,
    an interval away. A mark for a unit not scheduled here is dropped; a second ask before
    the tick finds the mark there already."""
    from drsvc import schedule_changes
    r = redis.Redis(port=redis_port)
    later = time.time() + 1800
    cfg = _pool_of(tmp_path, redis_port, 20, interval=3600, start_time=later)
    s = _leader(cfg)
    try:
        units = sorted(s.index.runs)
        slot = s.index.runs[units[7]].due
        enqueue_sync(str(cfg.path), f"vol-{'e' * 24}", 3600)    # the app's connection, made once per process
        r.delete(cfg.queue)
        assert schedule_changes.ask_soon(cfg.pool, units[7])
        assert not schedule_changes.ask_soon(cfg.pool, units[7])
        assert schedule_changes.ask_soon(cfg.pool, f"vol-{'d' * 24}")     # no such unit here
        s.tick()
        assert s.work.per_tick[-1][2] == 1
        assert [m["unit"] for m in _queued(r, cfg.queue)] == [units[7]]
        assert s.index.runs[units[7]].due == pytest.approx(slot, abs=1e-3)
        assert schedule_changes.take_soon(cfg.pool) == []
        s.tick()
        assert s.work.per_tick[-1][2] == 0 and len(_queued(r, cfg.queue)) == 1
    finally:
        s._resign()


def test_the_job_store_of_earlier_versions_is_taken_over(tmp_path):
    """A pool scheduled by APScheduler's SQLAlchemy job store (its table: id, next_run_time
    as epoch seconds, the pickled job) keeps each unit's next run: the first leader after the
    upgrade reads them as its due runs (and so replays the ones it missed), and drops the table."""
    import sqlite3

    from workers.due_runs import RunTable
    path = tmp_path / "scheduler.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE apscheduler_jobs (id VARCHAR(191) PRIMARY KEY, next_run_time FLOAT, job_state BLOB)")
    db.executemany("INSERT INTO apscheduler_jobs VALUES (?, ?, ?)",
                   [("sync:vol-1", 1000.5, b"x"), ("sync:vol-2", 2000.0, b"x"), ("sync:vol-3", None, b"x")])
    db.commit()
    db.close()
    t = RunTable(path)
    assert t.load() == {"vol-1": (1000.5, 0), "vol-2": (2000.0, 0)}     # paused jobs have no run
    t.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT name FROM sqlite_master WHERE name='apscheduler_jobs'").fetchone() is None
    db.close()
