"""A caller that dies between its claim and its send leaves no task behind.

CI found it (tests/faults/test_restarts.py::test_plugin_restarted_during_promote, seed
868404299): the plugin, killed while it served PromoteVolume, had claimed the unit in
Redis but never queued the task. Every retry then followed that task, which would never
run, and answered ABORTED ("in progress; retry to follow it") for the claim's whole life
(6 h). A CO retries an ABORTED failover all that while (kubernetes-csi-addons
internal/controller/replication.storage/volumereplication_controller.go: markVolumeAsPrimary
returns Promote's error from the reconcile, which is requeued with backoff), so the
failover could not finish.

Now a claim is a lease: it lives `inflight.PENDING` seconds until its task is known to be
queued (the caller confirms after sending, the worker again when it starts), then
`inflight.TTL`. Real Celery workers, Redis, sshd and loop-mounted XFS pools.
"""
from __future__ import annotations

import time
import uuid

import grpc
import pytest
import redis

from drsvc.config import load
from drsvc.replication.state import find_state
from tests.dr.helpers import generation, wait_for, write_random
from tests.faults.steps import receiver_pids
from workers import inflight
from workers.app import make_app

MiB = 1 << 20


def _enabled(lab, name, **params):
    A, sa = lab.clients["a"], lab.sites["a"]
    vol = A.create_volume(name, size=64 * MiB).volume_id
    write_random(sa, vol, count=8, size=128 << 10, seed=name)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h", **params})
    wait_for(lambda: generation(sa, vol) >= 1, 90, what="the initial sync")
    return vol


def test_a_claim_whose_caller_died_before_sending_lapses(lab):
    A, sa = lab.clients["a"], lab.sites["a"]
    cfg = load(sa.config_path)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, "orphan")

    # what a plugin killed between its claim and its send leaves: a claim, no task
    orphan = f"never-sent-{uuid.uuid4()}"
    held = inflight.claim(r, cfg.scope, vol, "demote", {"force": False}, orphan)
    assert held["task_id"] == orphan
    assert 0 < r.pttl(inflight.key(cfg.scope, vol)) <= inflight.PENDING * 1000

    # while it is young, the same request follows it (the sender may still be sending)
    with pytest.raises(grpc.RpcError) as refused:
        A.call("DemoteVolume", volume_id=vol)
    assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value
    assert orphan in refused.value.details(), refused.value.details()

    # then it lapses, and the CO's next retry runs the demote
    A.retry("DemoteVolume", volume_id=vol, attempts=int(inflight.PENDING * 4) + 60)
    assert find_state(sa.pool, vol).role == "secondary"
    assert inflight.holder(r, cfg.scope, vol) is None          # released by the task that ran


def test_a_running_task_holds_its_claim_past_the_lease(lab):
    """The caller died right after sending: the worker that starts the task confirms the
    claim, so a retry still follows the running task instead of starting a second one."""
    sa = lab.sites["a"]
    cfg = load(sa.config_path)
    app = make_app(cfg)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, "leased", bandwidthLimit=str(4 * MiB))
    write_random(sa, vol, count=64, size=256 << 10, seed=1)     # 16 MiB at 4 MiB/s: ~4 s

    task_id = str(uuid.uuid4())
    kwargs = {"trigger": "manual"}
    lease = 1.0
    inflight.claim(r, cfg.scope, vol, "sync", kwargs, task_id, pending=lease)
    lapse = time.time() + r.pttl(inflight.key(cfg.scope, vol)) / 1000     # when it ends unconfirmed
    app.send_task("drsvc.sync", args=[vol], kwargs=kwargs, task_id=task_id, queue=cfg.queue_for("sync"))
    before = generation(sa, vol)
    wait_for(lambda: receiver_pids(lab.sites["b"].pool), 30, interval=0.02, what="the sync to reach b")
    wait_for(lambda: time.time() > lapse + 0.5, 10, interval=0.05, what="the end of the claim's first lease")
    assert generation(sa, vol) == before, "the sync ended before the lease: this run shows nothing"
    held = inflight.holder(r, cfg.scope, vol)
    assert held and held["task_id"] == task_id, held
    assert r.ttl(inflight.key(cfg.scope, vol)) > inflight.PENDING
    wait_for(lambda: generation(sa, vol) > before, 90, what="the sync to land")
    wait_for(lambda: inflight.holder(r, cfg.scope, vol) is None, 10, what="the claim's release")
