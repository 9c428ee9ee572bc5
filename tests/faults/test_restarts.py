"""Processes of a site die or restart in the middle of work: the Celery worker (kill -9
mid-sync), redis-server (during a sync and during Promote), the plugin (during Promote
and Resync). Redelivered or re-issued work completes; nothing acked is lost; no two
syncs of one unit ever run at once."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import generation, wait_for, wait_synced_after, write_random
from tests.fixtures.sites import image_sha

from .steps import (MiB, Generations, check_converged, intervals_overlap, receiver_pids, reissue,
                    status, sync_now, write_quiesced)
from .tally import fault


def _quiet(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001 - the call is meant to be cut short
        pass


def _in_background(fn, *args, **kw):
    t = threading.Thread(target=_quiet, args=(fn, *args), kwargs=kw, daemon=True)
    t.start()
    return t


def _replicated(lab, name, size, *, bw=0, interval="1h", written=32):
    A = lab.clients["a"]
    sa = lab.sites["a"]
    vol = A.create_volume(name, size).volume_id
    write_random(sa, vol, count=written, seed=name)
    gens = Generations()
    gens.record(sa, vol)
    params = {"schedulingInterval": interval}
    if bw:
        params["bandwidthLimit"] = str(bw)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=params)
    wait_for(lambda: generation(sa, vol) >= 1, 90, what="initial sync")
    return vol, gens


def worker_kills(lab, rnd, rounds):
    sa, sb = lab.sites["a"], lab.sites["b"]
    A = lab.clients["a"]
    # throttled to ~1.5 s a sync, well under the visibility timeout
    vol, gens = _replicated(lab, f"wkill-{rnd.randrange(1 << 30)}", 128 * MiB, bw=24 * MiB)
    resumed = 0
    for _ in range(rounds):
        write_random(sa, vol, count=rnd.randint(96, 160), size=256 << 10, seed=rnd.random())
        gens.record(sa, vol)
        target = generation(sa, vol) + 1
        _in_background(sync_now, A, vol, 2)
        wait_for(lambda: receiver_pids(sb.pool), 30, interval=0.01, what="the sync to reach the peer")
        time.sleep(rnd.uniform(0.0, 1.2))
        sa.run.stop("worker", sig=signal.SIGKILL)
        fault()
        wait_for(lambda: not receiver_pids(sb.pool), 30, interval=0.02, what="the orphaned receiver to exit")
        gens.check_whole(sb, vol)
        sa.run.start("worker")
        # nobody asks again: the redelivered task (acks_late) finishes the generation
        wait_for(lambda target=target: generation(sa, vol) >= target, 120, what="the redelivered sync")
        gens.check_whole(sb, vol)
        check_converged(sa, sb, vol, [vol])
        resumed += find_state(sa.pool, vol).reports[-1]["resumed"]
    assert resumed >= 1, "no killed transfer resumed"
    assert not intervals_overlap(find_state(sa.pool, vol).reports)


def redis_during_sync(lab, rnd, rounds):
    """Redis restarts while a sync streams; the schedule (2 s) keeps running afterwards."""
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol, gens = _replicated(lab, f"rsync-{rnd.randrange(1 << 30)}", 128 * MiB, bw=32 * MiB, interval="2s")
    for _ in range(rounds):
        # the schedule runs while we write: hold the unit so no capture lands mid-write
        write_quiesced(sa, vol, count=rnd.randint(64, 128), size=256 << 10, seed=rnd.random())
        gens.record(sa, vol)
        target = generation(sa, vol) + 1
        wait_for(lambda: receiver_pids(sb.pool), 30, interval=0.01, what="a scheduled sync")
        time.sleep(rnd.uniform(0.0, 0.8))
        lab.restart_redis("a")
        fault()
        wait_for(lambda target=target: generation(sa, vol) >= target, 120, what="the sync in flight to land")
        gens.check_whole(sb, vol)
    # no schedule lost: syncs keep coming without anyone asking
    wait_synced_after(lab, vol, [vol], timeout=90)
    check_converged(sa, sb, vol, [vol])
    reports = find_state(sa.pool, vol).reports
    assert not intervals_overlap(reports), intervals_overlap(reports)
    st = status(lab.clients["a"], vol)
    assert st.status in ("HEALTHY", "UNKNOWN"), st.status_message


def _failover(lab, vol, old, new, *, during, rnd):
    """Planned failover old -> new; `during(site)` hits `new` while its Promote runs."""
    co, cn = lab.clients[old], lab.clients[new]
    so, sn = lab.sites[old], lab.sites[new]
    reissue(lambda: co.call("DemoteVolume", volume_id=vol), what="demote")
    before = find_state(so.pool, vol).epoch
    t = _in_background(cn.call, "PromoteVolume", volume_id=vol)
    time.sleep(rnd.uniform(0.0, 0.4))
    during(new)
    fault()
    t.join(timeout=90)
    reissue(lambda: cn.call("PromoteVolume", volume_id=vol), what="re-issued promote")
    st = find_state(sn.pool, vol)
    assert st.role == "primary" and st.epoch == before + 1, (st.role, st.epoch, before)
    assert find_state(so.pool, vol).role == "secondary"
    assert image_sha(so, vol) == image_sha(sn, vol)
    lab_verified()


def lab_verified():
    from .tally import TALLY
    TALLY.verified += 1


def promote_with(lab, rnd, rounds, during):
    sa = lab.sites["a"]
    vol, _ = _replicated(lab, f"prom-{rnd.randrange(1 << 30)}", 32 * MiB, interval="1h")
    sites = ["a", "b"]
    for i in range(rounds):
        old, new = sites[i % 2], sites[(i + 1) % 2]
        write_random(lab.sites[old], vol, count=8, seed=rnd.random())
        _failover(lab, vol, old, new, during=during, rnd=rnd)
    assert find_state(sa.pool, vol) is not None


def plugin_during_resync(lab, rnd, rounds):
    """Split brain by a forced promote at B; A, demoted with writes of its own, resyncs
    while its plugin is killed; the re-issued ResyncVolume reaches ready."""
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    for _ in range(rounds):
        vol, _ = _replicated(lab, f"rsy-{rnd.randrange(1 << 30)}", 32 * MiB, interval="2s")
        reissue(lambda vol=vol: B.call("PromoteVolume", volume_id=vol, force=True), what="forced promote")
        write_random(sb, vol, count=4, seed=rnd.random())
        write_random(sa, vol, count=4, seed=rnd.random())       # A's writes B never gets
        reissue(lambda vol=vol: A.call("DemoteVolume", volume_id=vol), what="demote")
        # force: A's own writes are discarded (without it the answer stays not ready)
        t = _in_background(A.call, "ResyncVolume", volume_id=vol, force=True)
        time.sleep(rnd.uniform(0.0, 0.3))
        sa.run.stop("plugin", sig=rnd.choice([signal.SIGKILL, signal.SIGTERM]))
        fault()
        sa.run.start("plugin")
        sa.run.wait_socket()
        t.join(timeout=60)
        def resync(vol=vol):
            return reissue(lambda: A.call("ResyncVolume", volume_id=vol, force=True), what="resync")
        wait_for(lambda: resync().ready, 90, what="resync to be ready")
        assert image_sha(sa, vol) == image_sha(sb, vol)
        lab_verified()
        reissue(lambda vol=vol: B.call("DisableVolumeReplication", volume_id=vol), what="disable")


def _restart_redis(lab):
    return lambda name: lab.restart_redis(name)


def _kill_plugin(lab, rnd):
    def hit(name):
        run = lab.sites[name].run
        run.stop("plugin", sig=rnd.choice([signal.SIGKILL, signal.SIGTERM]))
        run.start("plugin")
        run.wait_socket()
    return hit


@pytest.mark.faults
def test_worker_killed_mid_sync_is_redelivered(flab, rnd):
    worker_kills(flab, rnd, 4)


@pytest.mark.faults
def test_redis_restarted_during_sync(flab, rnd):
    redis_during_sync(flab, rnd, 3)


@pytest.mark.faults
def test_redis_restarted_during_promote(flab, rnd):
    promote_with(flab, rnd, 4, _restart_redis(flab))


@pytest.mark.faults
def test_plugin_restarted_during_promote(flab, rnd):
    promote_with(flab, rnd, 5, _kill_plugin(flab, rnd))


@pytest.mark.faults
def test_plugin_restarted_during_resync(flab, rnd):
    plugin_during_resync(flab, rnd, 2)


@pytest.mark.soak
def test_soak_restarts(flab, rnd):
    worker_kills(flab, rnd, 15)
    redis_during_sync(flab, rnd, 10)
    promote_with(flab, rnd, 10, _restart_redis(flab))
    promote_with(flab, rnd, 10, _kill_plugin(flab, rnd))
    plugin_during_resync(flab, rnd, 6)


