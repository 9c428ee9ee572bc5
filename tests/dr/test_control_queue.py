"""Control never waits behind data.

Enable, Demote and Promote go to the site's control queue, served by a worker of its own
(`drsvc worker --role control`); syncs go to the data queue. Here both processes of site
a's data worker are held by slow (throttled) syncs, and a planned failover of another
volume still completes at once: its tasks ran on the control worker while the slow syncs
were still running. Real Celery workers, Redis, sshd and loop-mounted XFS pools.
"""
from __future__ import annotations

import json

import redis

from drsvc.config import load
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import wait_for, write_random
from workers.app import make_app

MiB = 1 << 20


def _active_syncs(app) -> dict[str, set]:
    """The drsvc.sync tasks each worker is running now, by worker name."""
    active = app.control.inspect(timeout=3).active() or {}
    return {w: {t["id"] for t in tasks if t["name"].split()[0] == "drsvc.sync"} for w, tasks in active.items()}


def _task_meta(r, op: str, unit_id: str) -> list[dict]:
    out = []
    for key in r.scan_iter("celery-task-meta-*"):
        meta = json.loads(r.get(key))
        if meta.get("name") == f"drsvc.{op}" and (meta.get("args") or [None])[0] == unit_id:
            out.append(meta)
    return out


def test_failover_runs_on_the_control_worker_while_syncs_hold_the_data_worker(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    cfg = load(sa.config_path)
    app = make_app(cfg)
    r = redis.Redis.from_url(cfg.redis_url)

    slow = []
    for i in range(2):            # 64 MiB at 2 MiB/s: each initial sync holds a data process ~30 s
        v = A.create_volume(f"slow-{i}", size=96 * MiB).volume_id
        write_random(sa, v, count=64, size=MiB, seed=i)
        A.retry("EnableVolumeReplication", volume_id=v,
                parameters={"schedulingInterval": "1h", "bandwidthLimit": str(2 * MiB)})
        slow.append(v)
    busy = wait_for(lambda: (s := _active_syncs(app)) and max(map(len, s.values()), default=0) >= 2 and s,
                    60, interval=0.5, what="both data processes to run a slow sync")
    data_worker = next(w for w, ids in busy.items() if len(ids) >= 2)
    held = busy[data_worker]
    assert data_worker.startswith(f"{cfg.site}@")

    # a planned failover of another volume while the data worker is full
    vol = A.create_volume("urgent", size=64 * MiB).volume_id
    write_random(sa, vol, count=8, size=128 << 10, seed=7)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    A.retry("DemoteVolume", volume_id=vol)
    wait_for(lambda: find_state(sb.pool, vol), 30, what="the final sync to reach b")
    B.retry("PromoteVolume", volume_id=vol)
    assert find_state(sa.pool, vol).role == "secondary"
    assert find_state(sb.pool, vol).role == "primary"

    # the slow syncs are still running: the failover did not wait for them
    still = _active_syncs(app).get(data_worker, set())
    assert held <= still, "the slow syncs ended first: this run shows nothing about control"
    for op in ("enable", "demote"):
        metas = _task_meta(r, op, vol)
        assert metas and all(m["worker"].startswith(f"{cfg.site}-control@") for m in metas), metas
        assert all(m["queue"] == cfg.control_queue for m in metas), metas
    # at b the data worker is idle, so either worker may take the promote: it came by control
    rb = redis.Redis.from_url(load(sb.config_path).redis_url)
    metas = _task_meta(rb, "promote", vol)
    assert metas and all(m["queue"] == load(sb.config_path).control_queue for m in metas), metas

    # and the slow ones finish on the data worker, untouched
    wait_for(lambda: all((st := find_state(sb.pool, v)) and st.generation >= 1 for v in slow), 120,
             what="the slow initial syncs")
