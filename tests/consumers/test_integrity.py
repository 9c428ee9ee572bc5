"""The old primary is never rewritten underneath a mounted filesystem,
and a secondary is called consistent only when its content equals the primary's.

Follows kubernetes-csi-addons internal/controller/replication.storage/
volumereplication_controller.go (Reconcile -> markVolumeAsSecondary, then resyncVolume
with force = spec.autoResync), on a two-site lab through the plugin sockets.
"""
from __future__ import annotations

import os

from drsvc.replication.common.unit_state import find_state
from tests.consumers.flows import Code, publish, requeue, stage, status_of, unpublish, unstage
from tests.dr.helpers import wait_attempts, wait_for, wait_synced_after, write_random
from tests.fixtures.sites import image_sha

INTERVAL = {"schedulingInterval": "2s"}


def test_demote_refused_while_staged_then_resync_by_content(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("integ", 64 << 20).volume_id
    staging, target = lab.root / "a-stage", lab.root / "a-pub"
    stage(A, vol, staging)
    publish(A, vol, staging, target)
    (target / "before").write_bytes(os.urandom(1 << 20))
    os.sync()
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL, sidecar=True)
    wait_for(lambda: find_state(sb.pool, vol) and find_state(sb.pool, vol).generation >= 1, 60,
             what="initial sync")

    # forced failover: site A is lost, B takes over and writes
    lab.stop_sshd("a")
    sa.run.stop("worker")
    B.retry("PromoteVolume", volume_id=vol, force=True, sidecar=True)
    write_random(sb, vol, count=6, seed=31)
    sa.run.start("worker")
    lab.start_sshd("a")

    # A's app is moved away: unpublished, but its ext4 is still mounted at the staging path
    unpublish(A, vol, target)
    code, _ = status_of(lambda: A.call("DemoteVolume", volume_id=vol, sidecar=True))
    assert code == Code.FAILED_PRECONDITION
    try:
        A.call("DemoteVolume", volume_id=vol, sidecar=True)
    except Exception as e:          # noqa: BLE001 - the message names the attachment
        assert "staged at" in e.details() and str(staging) in e.details()
    assert find_state(sa.pool, vol).role == "primary"

    unstage(A, vol, staging)
    A.retry("DemoteVolume", volume_id=vol, sidecar=True)
    codes, resp = requeue(lambda: A.call("ResyncVolume", volume_id=vol, force=True, sidecar=True),
                          lambda c, r: c == Code.OK and r.ready, what="resync with force")
    assert image_sha(sa, vol) == image_sha(sb, vol)

    # a write the replica's state cannot see (a stale filesystem flushed at unstage, say)
    write_random(sa, vol, count=2, seed=32)
    changed = image_sha(sa, vol)
    # ResyncVolume judges A's content against B's snapshot; while a sync of B's lands, the
    # answer is "not verified" (ready False), and the controller calls again, as
    # kubernetes-csi-addons' volumereplication_controller.go requeues a resync not ready
    codes, resp = requeue(lambda: A.call("ResyncVolume", volume_id=vol, force=False, sidecar=True),
                          lambda c, r: c == Code.OK and (r.ready or find_state(sa.pool, vol).diverged),
                          what="resync without force to find A's stale write")
    assert resp.ready is False and find_state(sa.pool, vol).diverged
    wait_attempts(sb, vol, 2)        # two of B's syncs: without force nothing overwrites A
    assert image_sha(sa, vol) == changed
    requeue(lambda: A.call("ResyncVolume", volume_id=vol, force=True, sidecar=True),
            lambda c, r: c == Code.OK and r.ready, what="resync with force after the stale write")
    assert image_sha(sa, vol) == image_sha(sb, vol)
    # and it stays in step afterwards
    write_random(sb, vol, count=3, seed=33)
    wait_synced_after(lab, vol, [vol], src="b", dst="a")
