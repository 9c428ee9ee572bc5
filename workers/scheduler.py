"""APScheduler loop: one interval job per replicated unit, run only by the leader.

Jobs live in a SQLite job store beside the pool, and are reconciled from the
pool's durable replication state every few seconds, so schedules survive a
restart of this process and of Redis. Leadership is a Redis lock with a TTL;
a scheduler that cannot renew it stops acting.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
import uuid
from datetime import datetime, UTC
from functools import lru_cache
from pathlib import Path

import redis
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from drsvc.config import SiteConfig, load
from drsvc.pool import Pool
from drsvc.schedule import catch_up, phase, slot_at_or_before
from drsvc.replication.control import list_schedules, list_verify_schedules, write_next_runs

from .redis_client import connect
from .tasks import sync_marker, verify_marker
from .titles import set_title

log = logging.getLogger("workers.scheduler")
LEASE_S = 15


@lru_cache(maxsize=4)
def _app(config_path: str, node: str = ""):
    from .app import make_app
    return make_app(load(config_path, node=node))


def enqueue_sync(config_path: str, unit_id: str, interval: int, ph: float | None = None, node: str = "") -> None:
    """The job body: queue one sync unless one is already queued or running. The task
    carries the slot it was due at, so the worker can record the scheduling delay. On a
    multi-node site each node has its scheduler, over its pool, queueing to its queue."""
    app = _app(config_path, node)
    cfg = app.drsvc_config
    r = connect(cfg.redis_url, socket_timeout=10)
    # the marker outlives a dead worker only until its task would be redelivered
    ttl = max(30, min(3 * interval, cfg.visibility_timeout))
    if not r.set(sync_marker(cfg.scope, unit_id), "1", nx=True, ex=ttl):
        log.info("sync of %s still queued or running; not queueing another", unit_id)
        return
    kwargs = {"trigger": "schedule"}
    if ph is not None:
        kwargs["scheduled_at"] = round(slot_at_or_before(time.time(), interval, ph), 3)
    app.send_task("drsvc.sync", args=[unit_id], kwargs=kwargs, queue=cfg.queue_for("sync"))
    log.info("queued scheduled sync of %s", unit_id)


def enqueue_verify(config_path: str, unit_id: str, interval: int, node: str = "") -> None:
    """The verify job's body: queue one verify of a replica held here unless one is queued or
    running (its marker lasts as long as a verify may: the interval, at most a day)."""
    app = _app(config_path, node)
    cfg = app.drsvc_config
    r = connect(cfg.redis_url, socket_timeout=10)
    if not r.set(verify_marker(cfg.scope, unit_id), "1", nx=True, ex=max(60, min(interval, 86400))):
        log.info("verify of %s still queued or running; not queueing another", unit_id)
        return
    app.send_task("drsvc.verify", args=[unit_id], kwargs={"trigger": "schedule"}, queue=cfg.queue_for("verify"))
    log.info("queued scheduled verify of %s", unit_id)


def wanted_jobs(cfg: SiteConfig) -> dict:
    """The scheduler's jobs: a sync of every unit primary here, a verify of every replica held
    here that has a verify interval (the class's drsvc.io/verifyInterval, or verify_interval)."""
    node = cfg.node_id if cfg.is_node else ""
    out = {}
    for s in list_schedules(cfg.pool):
        ph = phase(s.unit_id, s.interval, s.start_time)
        out[f"sync:{s.unit_id}"] = (s, ph, enqueue_sync, [str(cfg.path), s.unit_id, s.interval, ph, node])
    for s in list_verify_schedules(cfg.pool, cfg.verify_interval):
        ph = phase(f"verify:{s.unit_id}", s.interval)
        out[f"verify:{s.unit_id}"] = (s, ph, enqueue_verify, [str(cfg.path), s.unit_id, s.interval, node])
    return out


class SiteScheduler:
    def __init__(self, cfg: SiteConfig, *, reconcile_every: float = 3.0, heartbeat: str | None = None):
        self.cfg = cfg
        self.heartbeat = Path(heartbeat) if heartbeat else None   # touched every loop (workers/probe.py)
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.reconcile_every = reconcile_every
        self.redis = connect(cfg.redis_url, socket_timeout=5)
        self.sched: BackgroundScheduler | None = None
        self.stop = threading.Event()
        self._published: dict | None = None

    @property
    def lock_key(self) -> str:
        return f"drsvc:{self.cfg.scope}:scheduler-leader"

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
            return self.sched is not None

    def _start(self) -> None:
        Pool(self.cfg.pool, site=self.cfg.site).init()     # a node's scheduler may start first
        store = SQLAlchemyJobStore(url=f"sqlite:///{self.cfg.pool}/scheduler.sqlite")
        self.sched = BackgroundScheduler(jobstores={"default": store}, timezone=UTC,
                                         job_defaults={"coalesce": True, "max_instances": 1,
                                                       "misfire_grace_time": 3600})
        self.sched.start(paused=True)
        self._catch_up()
        self.sched.resume()
        log.info("scheduler %s is leader for site %s", self.identity, self.cfg.site)

    def _catch_up(self) -> None:
        """Runs missed while no scheduler led (a leader change, a restart) are replayed at
        the pace they were due (drsvc.schedule.catch_up), not all at once."""
        now = time.time()
        missed = [(job.id, job.next_run_time.timestamp(), int(job.trigger.interval.total_seconds()))
                  for job in self.sched.get_jobs()
                  if job.next_run_time is not None and job.next_run_time.timestamp() < now]
        replay = catch_up(missed, now)
        for job_id, when in replay.items():
            self.sched.modify_job(job_id, next_run_time=datetime.fromtimestamp(when, UTC))
        if replay:
            log.info("taking over: %d missed run(s) replayed over %.1fs", len(replay),
                     max(replay.values()) - now)

    def _resign(self) -> None:
        if self.sched is not None:
            self.sched.shutdown(wait=False)
            self.sched = None
            log.info("scheduler %s is no longer leader", self.identity)

    def reconcile(self) -> None:
        wanted = wanted_jobs(self.cfg)
        for job in self.sched.get_jobs():
            if job.id not in wanted:
                job.remove()
        for job_id, (s, ph, body, args) in wanted.items():
            job = self.sched.get_job(job_id)
            if job is not None and job.trigger.interval.total_seconds() == s.interval:
                continue
            # slots at a fixed phase per unit (drsvc.schedule.phase): units spread over the
            # interval, and any leader computes the same slots
            start = datetime.fromtimestamp(ph, UTC)
            what = job_id.split(":", 1)[0]
            self.sched.add_job(body, IntervalTrigger(seconds=s.interval, start_date=start), id=job_id, args=args,
                               replace_existing=True, name=f"{what} {s.unit_id} every {s.interval}s")
            log.info("scheduled %s of %s every %ss", what, s.unit_id, s.interval)
        self._publish_next_runs()

    def _publish_next_runs(self) -> None:
        """Each unit's next run, for `drsvc status` (read by drsvc.replication.control.health.next_sync)."""
        runs = {job.id.removeprefix("sync:"): job.next_run_time.timestamp()
                for job in self.sched.get_jobs() if job.next_run_time is not None and job.id.startswith("sync:")}
        if runs != self._published:
            write_next_runs(self.cfg.pool, runs)
            self._published = runs

    def run(self) -> None:
        while not self.stop.is_set():
            if self._lead():
                if self.sched is None:
                    self._start()
                try:
                    self.reconcile()
                except Exception:  # noqa: BLE001 - keep scheduling the others
                    log.exception("reconcile failed")
            else:
                self._resign()
            if self.heartbeat is not None:
                self.heartbeat.touch()
            self.stop.wait(self.reconcile_every)
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
