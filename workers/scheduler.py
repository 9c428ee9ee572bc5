"""The site's scheduler: queues each replicated unit's sync at its slot; run only by the leader.

Each unit's next run sits in a heap by due time (workers.due_runs.DueIndex), so a tick pops
the due runs and nothing else. The units to schedule are read whole from the pool's durable
replication state once, when this process starts to lead; after that only the units
marked changed (drsvc.schedule_changes: enabled, disabled, promoted, demoted, interval or
start time changed) are read again. The next runs are kept in a table beside the pool
(``scheduler.sqlite``), so a new leader replays the runs missed while none led.
Leadership is a Redis lock with a TTL; a scheduler that cannot renew it stops acting.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
import uuid

import redis

from drsvc import schedule_changes
from drsvc.config import SiteConfig, load
from drsvc.pool import Pool
from drsvc.schedule import catch_up, phase, slot_at_or_before
from drsvc.replication.control import list_schedules, list_verify_schedules, schedule_of, verify_schedule_of
from drsvc.replication.control import write_next_runs

from .due_runs import DueIndex, Run, RunTable
from .redis_client import connect
from .tasks import sync_marker, verify_marker
from .titles import set_title

log = logging.getLogger("workers.scheduler")
LEASE_S = 15
PUBLISH_EVERY_S = 30.0      # the next runs are republished at most this often once runs fired
SWEEP_EVERY_S = 3600.0
VERIFY_PREFIX = "verify:"   # a replica's verify run, beside its unit's sync run (keyed by the unit id)      # every unit is read again this often (a change whose mark was lost)


@lru_cache(maxsize=4)
def _app(config_path: str, node: str = ""):
    from .app import make_app
    return make_app(load(config_path, node=node))


@lru_cache(maxsize=4)
def _redis(config_path: str, node: str = ""):
    return connect(_app(config_path, node).drsvc_config.redis_url, socket_timeout=10, socket_connect_timeout=5)


def enqueue_sync(config_path: str, unit_id: str, interval: int, ph: float | None = None, node: str = "") -> None:
    """Queue one sync unless one is already queued or running. The task carries the slot
    it was due at, so the worker can record the scheduling delay. Nobody waits on a
    scheduled sync, so its result is not stored (the worker logs it). On a multi-node
    site each node has its scheduler, over its pool, queueing to its queue."""
    app = _app(config_path, node)
    cfg = app.drsvc_config
    # the marker outlives a dead worker only until its task would be redelivered
    ttl = max(30, min(3 * interval, cfg.visibility_timeout))
    if not _redis(config_path, node).set(sync_marker(cfg.scope, unit_id), "1", nx=True, ex=ttl):
        log.info("sync of %s still queued or running; not queueing another", unit_id)
        return
    kwargs = {"trigger": "schedule"}
    if ph is not None:
        kwargs["scheduled_at"] = round(slot_at_or_before(time.time(), interval, ph), 3)
    app.send_task("drsvc.sync", args=[unit_id], kwargs=kwargs, queue=cfg.queue_for("sync"), ignore_result=True)
    log.info("queued scheduled sync of %s", unit_id)


def enqueue_verify(config_path: str, unit_id: str, interval: int, node: str = "") -> None:
    """The verify job's body: queue one verify of a replica held here unless one is queued or
    running (its marker lasts as long as a verify may: the interval, at most a day)."""
    app = _app(config_path, node)
    cfg = app.drsvc_config
    if not _redis(config_path, node).set(verify_marker(cfg.scope, unit_id), "1", nx=True, ex=max(60, min(interval, 86400))):
        log.info("verify of %s still queued or running; not queueing another", unit_id)
        return
    app.send_task("drsvc.verify", args=[unit_id], kwargs={"trigger": "schedule"}, queue=cfg.queue_for("verify"),
                  ignore_result=True)
    log.info("queued scheduled verify of %s", unit_id)


def first_slot_after(now: float, interval: int, ph: float) -> float:
    """The unit's first slot at or after *now* (slots: phase + k * interval)."""
    slot = slot_at_or_before(now, interval, ph)
    return slot if slot >= now else slot + interval


@dataclass
class TickWork:
    """What the leader did, counted (tests hold a tick's work to the due units)."""
    ticks: int = 0
    units_read: int = 0        # units whose records were read (changed, or all on a load)
    fired: int = 0
    loads: int = 0
    per_tick: list = field(default_factory=list)   # (units_read, heap pops, fired) of recent ticks


class SiteScheduler:
    def __init__(self, cfg: SiteConfig, *, reconcile_every: float = 3.0, heartbeat: str | None = None,
                 sweep_every: float = SWEEP_EVERY_S):
        self.cfg = cfg
        self.heartbeat = Path(heartbeat) if heartbeat else None   # touched every loop (workers/probe.py)
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.reconcile_every = reconcile_every
        self.sweep_every = sweep_every
        self.redis = connect(cfg.redis_url, socket_timeout=5)
        self.index: DueIndex | None = None        # set while leading
        self.table: RunTable | None = None
        self.stop = threading.Event()
        self.work = TickWork()
        self._dirty = False                       # the published next runs are stale
        self._published_at = 0.0
        self._swept_at = 0.0
        self._unsaved: dict[str, Run] = {}        # next runs of fired units, saved with the lease

    @property
    def lock_key(self) -> str:
        return f"drsvc:{self.cfg.scope}:scheduler-leader"

    @property
    def leading(self) -> bool:
        return self.index is not None

    def _lead(self) -> bool:
        """Take or renew the leader lease."""
        try:
            if self.redis.set(self.lock_key, self.identity, nx=True, ex=LEASE_S):
                return True
            if self.redis.get(self.lock_key) == self.identity.encode():
                self.redis.expire(self.lock_key, LEASE_S)
                return True
            return False
        except redis.RedisError as e:
            # without Redis no sync can be queued anyway; keep the role we had
            log.warning("leader lease: Redis unreachable (%s)", type(e).__name__)
            return self.leading

    # -- leading ---------------------------------------------------------------------------
    def _start(self) -> None:
        Pool(self.cfg.pool, site=self.cfg.site).init()     # a node's scheduler may start first
        self.table = RunTable(Path(self.cfg.pool) / "scheduler.sqlite")
        self.index = DueIndex()
        self._load(catch_up_missed=True)
        log.info("scheduler %s is leader for site %s", self.identity, self.cfg.site)

    def _wanted(self, unit_id: str | None = None) -> dict[str, tuple[int, float]]:
        """The runs a unit (or, without one, every unit) wants here, by job key -> (interval,
        phase): its sync while it is primary here (key: the unit id), its verify while its
        replica is held here (key: VERIFY_PREFIX + the unit id). Slots sit at a fixed phase
        per job (drsvc.schedule.phase): jobs spread over the interval, and any leader
        computes the same slots."""
        pool, default = self.cfg.pool, self.cfg.verify_interval
        if unit_id is None:
            syncs, verifies = list_schedules(pool), list_verify_schedules(pool, default)
        else:
            syncs = [s for s in (schedule_of(pool, unit_id),) if s is not None]
            verifies = [s for s in (verify_schedule_of(pool, unit_id, default),) if s is not None]
        out = {s.unit_id: (s.interval, phase(s.unit_id, s.interval, s.start_time)) for s in syncs}
        for s in verifies:
            key = VERIFY_PREFIX + s.unit_id
            out[key] = (s.interval, phase(key, s.interval))
        return out

    def _load(self, *, catch_up_missed: bool) -> None:
        """Every unit read afresh: on taking the lead (runs missed while no scheduler led, a
        leader change or a restart, are replayed at the pace they were due:
        drsvc.schedule.catch_up, not all at once), and on the slow sweep."""
        schedule_changes.take(self.cfg.pool)      # what they marked is read now
        wanted = self._wanted()
        self.work.units_read += len({k.removeprefix(VERIFY_PREFIX) for k in wanted})
        self.work.loads += 1
        stored = self.table.load() if catch_up_missed else {}
        now = time.time()
        missed, put = [], []
        for key, (every, ph) in wanted.items():
            cur = self.index.runs.get(key)
            if cur is not None and (cur.interval, cur.phase) == (every, ph):
                continue
            due, interval = stored.get(key, (0.0, 0))
            if not due or interval not in (0, every):
                due = first_slot_after(now, every, ph)
            elif due < now:
                missed.append((key, due, every))
            put.append(Run(key, due, every, ph))
        replay = catch_up(missed, now)
        put = [Run(r.unit_id, replay.get(r.unit_id, r.due), r.interval, r.phase) for r in put]
        for r in put:
            self.index.put(r)
        gone = [u for u in list(self.index.runs) if u not in wanted]
        for u in gone:
            self.index.remove(u)
        gone += [u for u in stored if u not in wanted]
        self.table.save(put, gone)
        self._dirty = self._dirty or bool(put or gone)
        self._swept_at = now
        if replay:
            log.info("taking over: %d missed run(s) replayed over %.1fs", len(replay),
                     max(replay.values()) - now)

    def _changes(self) -> int:
        """The units marked changed, read again: their runs added, rescheduled or dropped."""
        units = schedule_changes.take(self.cfg.pool)
        put, gone = [], []
        now = time.time()
        for unit_id in units:
            wanted = self._wanted(unit_id)
            for key in (unit_id, VERIFY_PREFIX + unit_id):
                cur = self.index.runs.get(key)
                if key not in wanted:
                    if cur is not None:
                        log.info("unscheduled %s", key)
                        self.index.remove(key)
                    gone.append(key)
                    continue
                every, ph = wanted[key]
                if cur is not None and (cur.interval, cur.phase) == (every, ph):
                    continue
                run = Run(key, first_slot_after(now, every, ph), every, ph)
                self.index.put(run)
                put.append(run)
                log.info("scheduled %s every %ss", key, every)
        self.table.save(put, gone)
        self._dirty = self._dirty or bool(put or gone)
        self.work.units_read += len(units)
        return len(units)

    def _soon(self) -> int:
        """The units whose peer asked for their next sync now (a resync or a repair waits on
        it: ``schedule_changes.ask_soon``): that run moves to now, and the slots after it
        stay the unit's own. A mark for a unit not synced from here is dropped."""
        now = time.time()
        moved = 0
        for unit_id in schedule_changes.take_soon(self.cfg.pool):
            cur = self.index.runs.get(unit_id)
            if cur is None or cur.due <= now:
                continue
            self.index.put(Run(unit_id, now, cur.interval, cur.phase))
            moved += 1
            log.info("%s: its peer asked for its next sync now", unit_id)
        return moved

    def _enqueue(self, run: Run, node: str) -> None:
        if run.unit_id.startswith(VERIFY_PREFIX):
            enqueue_verify(str(self.cfg.path), run.unit_id.removeprefix(VERIFY_PREFIX), run.interval, node)
        else:
            enqueue_sync(str(self.cfg.path), run.unit_id, run.interval, run.phase, node)

    def _fire_due(self) -> int:
        """Queue every due run; each job's next run is its next slot."""
        now = time.time()
        due = self.index.pop_due(now)
        if not due:
            return 0
        node = self.cfg.node_id if self.cfg.is_node else ""
        broken = None
        for r in due:
            if broken is None:
                try:
                    self._enqueue(r, node)
                except redis.RedisError as e:       # the others of this tick would wait on it too
                    broken = e
            if broken is not None:
                log.warning("%s not queued: Redis unreachable (%s)", r.unit_id, type(broken).__name__)
            run = Run(r.unit_id, first_slot_after(max(now, r.due) + 1e-3, r.interval, r.phase), r.interval, r.phase)
            self.index.put(run)
            self._unsaved[run.unit_id] = run
        self.work.fired += len(due)
        return len(due)

    def _publish_next_runs(self, now: float) -> None:
        """Each unit's next run, for `drsvc status` (read by drsvc.replication.control.health.next_sync):
        when the schedule changed, and at most every PUBLISH_EVERY_S while runs fire (a
        reader rolls a passed run forward on its grid meanwhile)."""
        if self._dirty or (self.work.fired and now - self._published_at >= PUBLISH_EVERY_S):
            write_next_runs(self.cfg.pool, {u: r.due for u, r in self.index.runs.items()
                                            if not u.startswith(VERIFY_PREFIX)})
            self._published_at, self._dirty = now, False

    def _save_fired(self) -> None:
        """The fired units' next runs into the table, once per lease renewal rather than per
        tick: a leader lost meanwhile costs a replay of those few, never a lost schedule."""
        runs, self._unsaved = list(self._unsaved.values()), {}
        self.table.save([r for r in runs if self.index.runs.get(r.unit_id) == r], [])

    def _resign(self) -> None:
        if self.leading:
            self._save_fired()
            self.index = None
            self.table.close()
            self.table = None
            log.info("scheduler %s is no longer leader", self.identity)

    # -- the loop --------------------------------------------------------------------------
    def tick(self) -> None:
        """One leader's tick: read the changed units, queue the due runs, publish."""
        pops0, read0 = self.index.pops, self.work.units_read
        now = time.time()
        if now - self._swept_at >= self.sweep_every:
            self._load(catch_up_missed=False)
        else:
            self._changes()
        self._soon()
        fired = self._fire_due()
        self._publish_next_runs(time.time())
        self.work.ticks += 1
        self.work.per_tick = (self.work.per_tick + [(self.work.units_read - read0, self.index.pops - pops0,
                                                     fired)])[-100:]

    def _wait(self, renew_at: float) -> None:
        """Until the next due run or the next lease renewal, whichever comes first."""
        wake = renew_at
        if self.leading and (d := self.index.next_due()) is not None:
            wake = min(wake, d)
        self.stop.wait(max(0.0, wake - time.time()))

    def run(self) -> None:
        renew_at = 0.0
        while not self.stop.is_set():
            if time.time() >= renew_at:
                renew_at = time.time() + self.reconcile_every
                if not self._lead():
                    self._resign()
                elif not self.leading:
                    self._start()
                if self.leading:
                    self._save_fired()
                if self.heartbeat is not None:
                    self.heartbeat.touch()
            if self.leading:
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - keep scheduling the others
                    log.exception("scheduler tick failed")
                    self.stop.wait(1.0)
            self._wait(renew_at)
        self._resign()
        try:
            if self.redis.get(self.lock_key) == self.identity.encode():
                self.redis.delete(self.lock_key)
        except redis.RedisError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="drsvc scheduler")
    ap.add_argument("--config", default=os.environ.get("DRSVC_CONFIG"))
    ap.add_argument("--node", default=os.environ.get("DRSVC_NODE", ""),
                    help="a multi-node site: schedule this storage node's units (default: $DRSVC_NODE)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--heartbeat", help="a file touched on every loop, for a liveness probe (python -m workers.probe)")
    args = ap.parse_args(argv)
    if not args.config:
        ap.error("--config or DRSVC_CONFIG is required")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load(args.config, node=args.node)
    set_title("scheduler", cfg)
    s = SiteScheduler(cfg, heartbeat=args.heartbeat)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: s.stop.set())
    s.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
