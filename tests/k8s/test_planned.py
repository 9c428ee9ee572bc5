"""The DR flow through Kubernetes objects alone, as Ramen's VolumeReplicationGroup drives it
(RamenDR/ramen internal/controller/vrg_volrep.go: createVR, updateVR, checkVRStatus,
isVRConditionMet), against the csi-addons VolumeReplication controller
(kubernetes-csi-addons internal/controller/replication.storage/volumereplication_controller.go)
and its sidecar (internal/sidecar/service/volumereplication.go). The tests run in order on
one volume pair: setup, planned failover, failback; then the drsvc-only baseline the
failover is measured against."""
from __future__ import annotations

import time

import pytest

from . import dr
from .direct import Direct

pytestmark = pytest.mark.k8s

VR, MiB = dr.VR, dr.MiB
APP = "app-1"


@pytest.fixture(scope="module")
def flow():
    """What one test of the module leaves the next: handles, PVs, times."""
    return {}


def test_setup_primary_at_a_secondary_at_b(sites, flow, timings):
    """At a a PVC, then its VR primary; at b the PV and PVC restored with the same
    handle, then a VR secondary (Ramen: createVR, restorePVsAndPVCsForVolRep). The data
    written at a reaches b; a's VR shows its sync (lastSyncTime, lastSyncDuration,
    lastSyncBytes); b's, a secondary's, none."""
    vol, pv = dr.setup_pair(sites["a"], sites["b"], APP, timings)
    flow.update(vol=vol, pv=pv)


def test_planned_failover_to_b(sites, flow, timings):
    """a's VR to secondary, then b's to primary: the images equal (RPO 0: what a wrote
    just before the demote is at b). b's first answer as primary carries no sync time
    older than a's last ship (NOT_FOUND before b's first sync is the promise)."""
    sa, sb, vol = sites["a"], sites["b"], flow["vol"]
    a_last = dr.ts(sa.api.get(VR, APP, dr.NS)["status"].get("lastSyncTime"))
    dr.write(sa, vol, 8 * MiB, MiB, seed=2)
    demote, promote = dr.planned_failover(sa, sb, APP)
    assert dr.sha(sa, vol) == dr.sha(sb, vol)
    timings["planned failover, one VR: demote at a -> Completed"] = demote
    timings["planned failover, one VR: promote at b -> Completed"] = promote
    timings["planned failover, one VR, through Kubernetes"] = demote + promote
    st = sb.api.get(VR, APP, dr.NS)["status"]
    assert dr.ts(st.get("lastSyncTime")) == 0.0 or dr.ts(st["lastSyncTime"]) >= a_last, st
    flow["failover_at"] = time.time()


def test_failback_ships_only_divergence(sites, flow, timings):
    """b, primary, writes 1 MiB; its next sync ships about that (lastSyncBytes), not
    the image; then b to secondary and a to primary, images equal."""
    sa, sb, vol = sites["a"], sites["b"], flow["vol"]
    dr.wait_sync_after(sb, APP, flow["failover_at"])       # b's first sync as primary
    t_write = time.time()
    written = dr.write(sb, vol, 16 * MiB, MiB, seed=3)
    st = dr.wait_sync_after(sb, APP, t_write)
    assert 0 < st["lastSyncBytes"] <= len(written) + 256 * 1024, st
    demote, promote = dr.planned_failover(sb, sa, APP)
    assert dr.sha(sa, vol) == dr.sha(sb, vol)
    timings["failback, one VR, through Kubernetes"] = demote + promote
    flow["failback_at"] = time.time()


def test_drsvc_only_planned_failover(sites, timings, k8s_world):
    """The same planned failover with no Kubernetes: DemoteVolume at a, PromoteVolume
    at b, straight to the plugins, the calls the sidecar makes (internal/sidecar/service/volumereplication.go)."""
    sa, sb = sites["a"], sites["b"]
    params = {"schedulingInterval": "30s"}
    a = Direct(sa.socket, k8s_world.lab.tokens["a"], params)
    b = Direct(sb.socket, k8s_world.lab.tokens["b"], params)
    try:
        vol = a.create_volume("direct-1")
        dr.write(sa, vol, 0, 4 * MiB, seed=7)
        a.call("EnableVolumeReplication", vol)
        sa.api.wait("direct-1's first sync", lambda: a.last_sync(vol), 120, interval=0.5)
        dr.write(sa, vol, 8 * MiB, MiB, seed=8)
        t0 = time.monotonic()
        _, aborted_demote = a.call("DemoteVolume", vol)
        t1 = time.monotonic()
        _, aborted_promote = b.call("PromoteVolume", vol)
        t2 = time.monotonic()
        assert dr.sha(sa, vol) == dr.sha(sb, vol)
    finally:
        a.close()
        b.close()
    timings["drsvc only: DemoteVolume at a"] = t1 - t0
    timings["drsvc only: PromoteVolume at b"] = t2 - t1
    timings["drsvc only: planned failover, one volume"] = t2 - t0
    timings["drsvc only: ABORTED answers (demote, promote)"] = (aborted_demote, aborted_promote)
