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
`inflight.TTL`. A caller that follows a task also looks where its message is
(workers/presence.py) and sends it again when it is nowhere; role changes run only for
the task that holds the claim, one at a time per unit. Real Celery workers, Redis, sshd
and loop-mounted XFS pools.
"""
from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
import redis

from drsvc.config import load
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import generation, wait_for, write_random
from tests.faults.steps import receiver_pids
from workers import inflight, presence
from workers.app import make_app

MiB = 1 << 20


def _enabled(lab, name, **params):
    A, sa = lab.clients["a"], lab.sites["a"]
    vol = A.create_volume(name, size=64 * MiB).volume_id
    write_random(sa, vol, count=8, size=128 << 10, seed=name)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h", **params})
    wait_for(lambda: generation(sa, vol) >= 1, 90, what="the initial sync")
    return vol


def test_a_claim_whose_caller_died_before_sending_is_taken_over(lab):
    A, sa = lab.clients["a"], lab.sites["a"]
    cfg = load(sa.config_path)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, "orphan")

    # what a plugin killed between its claim and its send leaves: a claim, no task
    orphan = f"never-sent-{uuid.uuid4()}"
    held = inflight.claim(r, cfg.scope, vol, "demote", {"force": False}, orphan)
    assert held["task_id"] == orphan
    assert 0 < r.pttl(inflight.key(cfg.scope, vol)) <= inflight.PENDING * 1000

    # the same request follows it, finds its task nowhere at two looks (workers/presence.py),
    # takes the unit over and runs the demote, within this one call: it need not wait for
    # the lease to lapse (inflight.PENDING stays the fallback when Redis cannot be asked)
    A.call("DemoteVolume", volume_id=vol)
    assert find_state(sa.pool, vol).role == "secondary"
    assert inflight.holder(r, cfg.scope, vol) is None          # released by the task that ran
    assert f"task {orphan} is queued nowhere" in sa.run.log_file("plugin").read_text()


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


def _control_queue_messages(r, cfg, task_id):
    q = cfg.queue_for("demote")
    return [m for m in r.lrange(q, 0, -1) if task_id.encode() in m]


def test_a_task_whose_message_was_lost_is_sent_again(lab):
    """kombu's Redis transport pops a message (BRPOP) and only then records it as unacked
    (kombu/transport/redis.py: Channel._brpop_read, then QoS.append). Redis restarting
    between the two loses the message, while the caller's confirmed claim lives on for
    hours: CI found it (tests/faults/test_restarts.py::test_redis_restarted_during_promote,
    seed 131602599), every re-issued Promote answered ABORTED "in progress". Here the
    message is taken off the queue by hand while no worker listens, which leaves what that
    loss leaves: a claim, confirmed, and no message anywhere. The caller still waiting finds
    the task lost (workers/presence.py), sends it again, and answers OK."""
    A, sa = lab.clients["a"], lab.sites["a"]
    cfg = load(sa.config_path)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, "lostmsg")
    for c in ("control", "worker"):          # both consume the control queue
        sa.run.stop(c)
    try:
        answer = {}
        t = threading.Thread(target=lambda: answer.setdefault("v", _call(A, "DemoteVolume", volume_id=vol)))
        t.start()
        wait_for(lambda: (h := inflight.holder(r, cfg.scope, vol)) and _control_queue_messages(r, cfg, h["task_id"])
                 and r.ttl(inflight.key(cfg.scope, vol)) > inflight.PENDING, 30, interval=0.02,
                 what="the demote's confirmed claim and its queued message")
        lost = inflight.holder(r, cfg.scope, vol)["task_id"]
        for m in _control_queue_messages(r, cfg, lost):
            assert r.lrem(cfg.queue_for("demote"), 1, m) == 1
    finally:
        for c in ("control", "worker"):
            sa.run.start(c)
    t.join(timeout=60)
    # the waiting call answers OK, or (a worker slow to start under load) ABORTED, and the
    # CO's next retry follows the task sent again; before, every retry for 6 h was ABORTED
    assert answer.get("v") == "OK" or answer.get("v", "").startswith("ABORTED"), answer
    A.retry("DemoteVolume", volume_id=vol, attempts=10)
    assert find_state(sa.pool, vol).role == "secondary"
    assert inflight.holder(r, cfg.scope, vol) is None
    assert f"task {lost} is queued nowhere" in sa.run.log_file("plugin").read_text()


def _call(client, method, **kw):
    try:
        client.call(method, **kw)
        return "OK"
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"


@pytest.mark.parametrize("claim", ["none", "another task's"])
def test_a_role_change_that_outlived_its_caller_is_not_run(lab, claim):
    """A demote message with no claim of its own: a copy the visibility sweep redelivers
    after a Redis restart, long after its caller had its answer (or gave up, released the
    claim, and had a retry run). Run then, it would demote a unit the operator has since
    promoted again. The worker answers TaskSuperseded and leaves the unit as it is."""
    sa = lab.sites["a"]
    cfg = load(sa.config_path)
    app = make_app(cfg)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, f"stale-{claim.split()[0]}")
    stale = str(uuid.uuid4())
    if claim != "none":
        other = f"retry-{uuid.uuid4()}"
        inflight.claim(r, cfg.scope, vol, "demote", {"force": False}, other)
    res = app.send_task("drsvc.demote", args=[vol], kwargs={"force": False}, task_id=stale,
                        queue=cfg.queue_for("demote"))
    value = res.get(timeout=60, propagate=False)
    assert value["ok"] is False and value["error"] == "TaskSuperseded", value
    assert stale in value["message"]
    assert find_state(sa.pool, vol).role == "primary"
    if claim != "none":
        assert inflight.holder(r, cfg.scope, vol)["task_id"] == other       # not released by the stale copy
        inflight.release(r, cfg.scope, vol, other)


def test_two_copies_of_one_promote_promote_once(lab):
    """One promote message published twice (a publish retried as Redis restarts): both
    copies hold the claim, and the control worker runs two tasks at once. The second waits
    for the unit's role lock and finds it primary; the epoch moves by one. Found by
    tests/faults/test_restarts.py::test_redis_restarted_during_promote (seed 131602599):
    ('primary', 4, 2), an epoch moved by two."""
    A, B = lab.clients["a"], lab.clients["b"]
    sb = lab.sites["b"]
    cfg = load(sb.config_path)
    app = make_app(cfg)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, "twice")
    A.retry("DemoteVolume", volume_id=vol)
    before = find_state(sb.pool, vol).epoch
    task_id = str(uuid.uuid4())
    kwargs = {"force": False}
    inflight.claim(r, cfg.scope, vol, "promote", kwargs, task_id)
    inflight.confirm(r, cfg.scope, vol, task_id)
    for _ in range(2):
        app.send_task("drsvc.promote", args=[vol], kwargs=kwargs, task_id=task_id, queue=cfg.queue_for("promote"))
    wait_for(lambda: find_state(sb.pool, vol).role == "primary", 60, what="the promote")
    # both copies end (the second only after the first): the claim goes with the last
    wait_for(lambda: inflight.holder(r, cfg.scope, vol) is None, 60, what="both copies to end")
    assert find_state(sb.pool, vol).epoch == before + 1
    B.retry("DisableVolumeReplication", volume_id=vol)


def test_presence_tells_queued_taken_answered_and_absent(lab):
    """workers/presence.py reads kombu's own Redis layout (its queue lists and unacked hash,
    kombu/transport/redis.py: Channel._q_for_pri, QoS.append): each answer, on real Celery."""
    sa = lab.sites["a"]
    cfg = load(sa.config_path)
    app = make_app(cfg)
    r = redis.Redis.from_url(cfg.redis_url)
    vol = _enabled(lab, "presence", bandwidthLimit=str(4 * MiB))
    q = cfg.queue_for("sync")
    task_id = str(uuid.uuid4())
    assert presence.where(r, app, q, task_id) == presence.ABSENT

    for c in ("control", "worker"):
        sa.run.stop(c)
    try:
        app.send_task("drsvc.sync", args=[vol], kwargs={"trigger": "manual"}, task_id=task_id, queue=q)
        assert presence.where(r, app, q, task_id) == presence.QUEUED
        write_random(sa, vol, count=64, size=256 << 10, seed=2)     # 16 MiB at 4 MiB/s: ~4 s
    finally:
        for c in ("control", "worker"):
            sa.run.start(c)
    wait_for(lambda: receiver_pids(lab.sites["b"].pool), 60, interval=0.02, what="the sync to reach b")
    assert presence.where(r, app, q, task_id) == presence.TAKEN
    app.AsyncResult(task_id).get(timeout=90, propagate=False)
    assert presence.where(r, app, q, task_id) == presence.ANSWERED
    assert presence.where(r, app, q, str(uuid.uuid4())) == presence.ABSENT
