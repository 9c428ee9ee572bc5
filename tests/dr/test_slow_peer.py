"""One slow peer must not block syncs to other peers.

Site a replicates to two peers, b and c. Syncs to c are slow (throttled), and there are
more of them than a's data worker has processes. With several peers a site caps the
syncs to one peer at all but one worker process (per-peer slots in Redis,
workers/slots.py), so the volume replicated to b keeps its 2-second schedule while
c's syncs run one at a time. Real Celery workers, Redis, sshd and XFS pools, three sites.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import redis

from drsvc.config import load
from drsvc.replication.control.relationship import find_control
from drsvc.replication.common.unit_state import find_state
from drsvc_lab import Lab
from tests.dr.helpers import wait_for, write_random
from tests.fixtures.sites import need_lab, started
from workers import slots
from workers.app import make_app

MiB = 1 << 20


@pytest.fixture
def lab3():
    need_lab()
    with started(Lab(Path(tempfile.mkdtemp(prefix="drsvc-lab3-")), names=("a", "b", "c")).build()) as lab:
        yield lab


def _syncs(site, vol) -> int:
    c = find_control(site.pool, vol)
    return c.syncs_total if c else 0


def test_slow_peer_leaves_a_process_to_the_other_peer(lab3):
    A = lab3.clients["a"]
    sa, sc = lab3.sites["a"], lab3.sites["c"]
    cfg = load(sa.config_path)
    r = redis.Redis.from_url(cfg.redis_url)

    slow = []
    for i in range(2):            # 48 MiB at 2 MiB/s each: ~24 s a sync, to c
        v = A.create_volume(f"to-c-{i}", size=64 * MiB).volume_id
        write_random(sa, v, count=48, size=MiB, seed=i)
        A.retry("EnableVolumeReplication", volume_id=v, parameters={
            "peer": "c", "schedulingInterval": "1h", "bandwidthLimit": str(2 * MiB)})
        slow.append(v)
    app = make_app(cfg)

    def syncs_running() -> int:
        active = app.control.inspect(timeout=3).active() or {}
        return sum(1 for tasks in active.values() for t in tasks if t["name"].startswith("drsvc.sync"))
    wait_for(syncs_running, 60, interval=0.5, what="a sync to c to start")

    fast = A.create_volume("to-b", size=16 * MiB).volume_id
    write_random(sa, fast, count=4, size=64 << 10, seed=9)
    A.retry("EnableVolumeReplication", volume_id=fast, parameters={"peer": "b", "schedulingInterval": "2s"})

    # while the syncs to c are still running, the volume to b syncs again and again
    start = _syncs(sa, fast)
    most = 0
    deadline = time.monotonic() + 60
    while _syncs(sa, fast) < start + 3:
        assert time.monotonic() < deadline, ("syncs to b waited behind the slow peer; a's worker log:\n"
                                             + sa.run.log_file("worker").read_text()[-6000:])
        most = max(most, len(slots.holders(r, cfg.site, "c")))
        time.sleep(0.5)
    pending = [v for v in slow if not ((st := find_state(sc.pool, v)) and st.generation >= 1)]
    assert pending, "both slow syncs finished first: this run shows nothing about isolation"
    assert most <= 1                      # two processes, two peers: c holds at most one

    # and the slow peer's syncs all finish, one after the other
    wait_for(lambda: all((st := find_state(sc.pool, v)) and st.generation >= 1 for v in slow), 180,
             what="the syncs to c")
