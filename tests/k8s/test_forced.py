"""The forced failover, with every process of site a killed (its cluster and its drsvc
site), then a's return as secondary with autoResync, as Ramen fails over and then
relocates (internal/controller/vrg_volrep.go: autoResync is true for a Failover's
secondary). The controller promotes b with force after FAILED_PRECONDITION
(volumereplication_controller.go markVolumeAsPrimary); at a it demotes, then resyncs
with force = spec.autoResync (resyncVolume) until ready. Runs last: it takes a down."""
from __future__ import annotations

import time

import pytest

from . import dr
from .test_install import connected

pytestmark = pytest.mark.k8s

APP = "app-forced"


def test_forced_failover_then_resync(sites, timings, k8s_world):
    sa, sb = sites["a"], sites["b"]
    vol, _ = dr.setup_pair(sa, sb, APP, timings)
    t_write = time.time()
    dr.write(sa, vol, 4 * dr.MiB, dr.MiB, seed=50)
    a_last = dr.ts(dr.wait_sync_after(sa, APP, t_write)["lastSyncTime"])

    k8s_world.kill_site("a")
    t0 = time.monotonic()
    dr.set_state(sb, dr.VR, APP, "primary")
    promoted = dr.wait_state(sb, dr.VR, APP, "primary", t0=t0)
    dr.expect(promoted.obj, Completed=("True", "Promoted"), Degraded=("False", "Healthy"))
    timings["forced failover: promote at b (a down) -> Completed"] = promoted.seconds
    timings["forced failover: force promotes logged by b's manager"] = sb.cluster.count(
        "csi-addons-manager", "force promoting volume")
    # b's record of a sync older than what a shipped since must not be shown as b's last sync
    last = dr.ts(promoted.status.get("lastSyncTime"))
    assert last == 0.0 or last >= a_last, f"b shows a stale lastSyncTime {promoted.status.get('lastSyncTime')}"

    dr.write(sb, vol, 8 * dr.MiB, dr.MiB, seed=51)      # b, the new primary, writes
    dr.write(sa, vol, 12 * dr.MiB, dr.MiB, seed=52)     # a's divergence, written before it died
    k8s_world.restart_site("a")
    sa.api.wait("a: CSIAddonsNode Connected again", lambda: connected(sa), 120, interval=0.2)
    seen = []
    t1 = time.monotonic()
    dr.set_state(sa, dr.VR, APP, "secondary", auto_resync=True)
    back = dr.wait_state(sa, dr.VR, APP, "secondary", t0=t1, timeout=300, seen=seen)
    timings["forced failover: a back, secondary with autoResync -> Completed"] = back.seconds
    print("conditions seen at a:", seen)
    assert any(c.get("Resyncing") == ("True", "ResyncTriggered") for c in seen), seen
    assert dr.sha(sa, vol) == dr.sha(sb, vol)


LOOP = 3    # the same error for one unit more often than this is a requeue loop


def test_no_requeue_loop_on_drsvc_answers(sites, timings):
    """Over the whole run, no unit got the same error from drsvc more than LOOP times
    through the csi-addons sidecar: no ABORTED loop, NOT_FOUND only before a unit's first
    sync (volumereplication_controller.go treats it as "no info yet", getReplicationInfoKnownErrors)."""
    loops = {}
    for s in sites.values():
        codes = s.cluster.error_codes("csi-addons")
        for (code, unit), n in codes.items():
            timings[f"{s.name}: sidecar logged {code} for {unit}"] = n
            if n > LOOP:
                loops[(s.name, code, unit)] = n
    assert not loops, loops
