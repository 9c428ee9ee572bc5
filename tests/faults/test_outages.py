"""Longer outages: the peer's pool full, the peer's sshd down for several intervals, and
a forced failover whose old primary comes back writing (split brain). Each is reported
(status, message, lag metric), leaves the replica intact, and heals by itself or by the
runbook (demote + resync) with only the divergent blocks on the wire."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from drsvc import store
from drsvc.layout import PoolLayout
from drsvc.replication.common.unit_state import find_state
from drsvc_lab.net import WaitTimeout
from tests.dr.helpers import generation, wait_attempts, wait_for, wait_synced_after, write_random
from tests.fixtures.sites import image_sha

from .conftest import build_lab, close_lab
from .steps import MiB, Generations, check_converged, metric, reissue, status
from .tally import TALLY, fault


def _replicated(lab, name, size, interval="2s", written=32):
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume(name, size).volume_id
    write_random(sa, vol, count=written, seed=name)
    gens = Generations()
    gens.record(sa, vol)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": interval})
    wait_for(lambda: generation(sb, vol) >= 1, 90, what="initial sync")
    return vol, gens


@pytest.fixture
def small_peer_lab():
    lab = build_lab("drsvc-full-", pool_sizes={"b": "320M"})
    try:
        yield lab
    finally:
        close_lab(lab)


@pytest.mark.faults
def test_peer_pool_full(small_peer_lab):
    lab = small_peer_lab
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol, gens = _replicated(lab, "full", 128 * MiB)
    wait_synced_after(lab, vol, [vol])
    before_gen, before_sha = generation(sb, vol), image_sha(sb, vol)

    # everything but 4 MiB of b's filesystem goes to a file beside the pool
    filler = sb.pool.parent / "filler"
    fs = os.statvfs(sb.pool)
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, fs.f_bavail * fs.f_frsize - 4 * MiB)
    finally:
        os.close(fd)
    fault()
    # 48 MiB: more than is left. Written under the unit's lock, as a sync holds it: a
    # scheduled sync that captured the image part-way through (its first MiB or two fit in
    # what is left) would land a generation that is none of the ones recorded here
    with store.file_lock(PoolLayout(sa.pool).lock_path(vol), key=vol):
        write_random(sa, vol, count=48, size=1 * MiB, seed=7)
    gens.record(sa, vol)
    free_before = os.statvfs(sb.pool).f_bavail * os.statvfs(sb.pool).f_frsize
    # a sync still running under load reads DEGRADED as "behind schedule" first, and an
    # attempt whose channel closed before the receiver's answer reads as a lost connection:
    # wait for the full pool's own failure (the schedule retries every interval)
    seen = set()

    def failed_for_space():
        s = status(A, vol)
        if s.status == "DEGRADED" and "failure" in s.status_message:
            seen.add(s.status_message)
            return "space" in s.status_message.lower() and s
        return False
    try:
        st = wait_for(failed_for_space, 90, what="DEGRADED by the full pool")
    except WaitTimeout:
        raise AssertionError(f"no sync failed for the full pool; the failures seen: {sorted(seen)}") from None
    print("pool full:", st.status_message, "; before it:", sorted(seen - {st.status_message}))
    # a named error that says how much was needed, not an OSError
    assert "the DR pool at the peer is full: this sync needs about" in st.status_message, st.status_message
    assert "Errno" not in st.status_message and "OSError" not in st.status_message
    rc, doc = _cli(sa, "sync-now", "--volume", vol, "--wait")
    assert rc != 0 and doc["error"]["code"] == "RESOURCE_EXHAUSTED", doc
    # the unit's lock at a, as a sync holds it: no scheduled sync begins a journal of its own
    # at b while the failed ones' leftovers are looked for
    with store.file_lock(PoolLayout(sa.pool).lock_path(vol), key=vol):
        # the failed transaction's data is gone: the space is there for the other units' syncs
        # (a receiver whose sender stopped waiting may still be removing it)
        journal = PoolLayout(sb.pool).journal_dir(vol)
        try:
            wait_for(lambda: not journal.exists(), 30, what="the failed journal removed")
        except WaitTimeout:
            raise AssertionError(f"left at b: {sorted(str(p) for p in journal.rglob('*'))}") from None
        free_after = os.statvfs(sb.pool).f_bavail * os.statvfs(sb.pool).f_frsize
        assert free_after >= free_before - 1 * MiB, (free_before, free_after)
        # the replica keeps its last whole generation: the bytes from before the filler (a
        # scheduled sync with nothing new may still land a generation of its own under load)
        assert generation(sb, vol) >= before_gen
        assert gens.check_whole(sb, vol) == before_sha

    filler.unlink()
    # nobody intervenes: the schedule's next attempts get through
    wait_for(lambda: status(A, vol).status == "HEALTHY", 120, what="recovery after space is freed")
    wait_synced_after(lab, vol, [vol], timeout=90)
    check_converged(sa, sb, vol, [vol])


def _cli(site, *args):
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", *args, "--config", str(site.config_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def _scrape(site) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{site.cfg.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.faults
def test_peer_sshd_down_for_intervals(flab):
    A = flab.clients["a"]
    sa, sb = flab.sites["a"], flab.sites["b"]
    vol, gens = _replicated(flab, "sshd-down", 32 * MiB)
    wait_synced_after(flab, vol, [vol])
    flab.stop_sshd("b")
    fault()
    write_random(sa, vol, count=8, seed=8)
    gens.record(sa, vol)
    # a sync still running under load reads DEGRADED as "behind schedule" first: wait for the
    # failure itself
    st = wait_for(lambda: (s := status(A, vol)).status == "DEGRADED" and "failure" in s.status_message and s,
                  90, what="DEGRADED by a failed sync")
    assert st.consecutive_failures >= 1, st
    lag1 = metric(_scrape(sa), "drsvc_replication_lag_seconds", vol)
    assert lag1 is not None
    wait_attempts(sa, vol, 2)         # two more failed syncs: the lag only grows
    lag2 = metric(_scrape(sa), "drsvc_replication_lag_seconds", vol)
    assert lag2 > lag1, (lag1, lag2)
    gens.check_whole(sb, vol)

    flab.start_sshd("b")
    # catches up by itself: the retried task or the schedule
    wait_for(lambda: image_sha(sb, vol) == gens.known[vol][-1], 120, what="catch-up after sshd returns")
    wait_for(lambda: status(A, vol).status == "HEALTHY", 60, what="HEALTHY again")
    wait_synced_after(flab, vol, [vol], timeout=60)
    check_converged(sa, sb, vol, [vol])
    lag3 = metric(_scrape(sa), "drsvc_replication_lag_seconds", vol)
    assert lag3 < lag2


@pytest.mark.faults
def test_split_brain_fenced_and_resynced(flab):
    A, B = flab.clients["a"], flab.clients["b"]
    sa, sb = flab.sites["a"], flab.sites["b"]
    vol, gens = _replicated(flab, "split", 64 * MiB)
    wait_synced_after(flab, vol, [vol])

    # site a is lost; b takes over by force and writes
    flab.stop_sshd("a")
    sa.run.stop("worker")
    fault()
    reissue(lambda: B.call("PromoteVolume", volume_id=vol, force=True), what="forced promote")
    written = write_random(sb, vol, count=6, seed=12)
    b_sha = image_sha(sb, vol)
    # a comes back still primary and keeps writing
    written += write_random(sa, vol, count=6, seed=13)
    sa.run.start("worker")
    flab.start_sshd("a")

    st = wait_for(lambda: (s := status(A, vol)).status == "ERROR" and s, 60, what="a to report the conflict")
    assert "split brain" in st.status_message, st.status_message
    # a's deltas were refused: b's data is untouched
    assert image_sha(sb, vol) == b_sha
    TALLY.verified += 1
    assert find_state(sb.pool, vol).epoch > find_state(sa.pool, vol).epoch

    reissue(lambda: A.call("DemoteVolume", volume_id=vol), what="demote")
    # a's own writes are kept until a resync with force discards them
    assert not reissue(lambda: A.call("ResyncVolume", volume_id=vol), what="resync").ready
    wait_for(lambda: reissue(lambda: A.call("ResyncVolume", volume_id=vol, force=True), what="resync").ready,
             90, what="resync to finish")
    b_now = image_sha(sb, vol)
    assert image_sha(sa, vol) == b_now
    TALLY.verified += 1
    compare = [r for r in find_state(sb.pool, vol).reports if r["mode"] == "compare"]
    assert compare, "no compare sync ran"
    # only the divergent blocks (both sides' writes, block-rounded), not 64 MiB
    assert compare[-1]["bytes_changed"] <= written + 2 * MiB, compare[-1]
    assert compare[-1]["bytes_on_wire"] < 4 * written, compare[-1]
