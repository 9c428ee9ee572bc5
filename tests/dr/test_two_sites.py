"""Two real sites, everything through gRPC."""
from __future__ import annotations

import threading
import time

import grpc

from csi_plugin.gen import csi_pb2, volumegroup_pb2
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import (code_of, generation, last_report, wait_attempts, wait_for, wait_synced_after,
                              write_random)
from tests.faults.steps import receiver_pids
from tests.fixtures.sites import image_sha

INTERVAL = {"schedulingInterval": "2s"}


def _group(client, name, n=3):
    g = client.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name=name)).volume_group
    vols = [client.create_volume(f"{name}-m{i}", 32 << 20, volumeGroup=g.volume_group_id) for i in range(n)]
    return g.volume_group_id, [v.volume_id for v in vols]


def test_volume_and_group_replicate_on_schedule(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    sa = lab.sites["a"]
    vol = A.create_volume("db", 64 << 20).volume_id
    gid, members = _group(A, "app")
    write_random(sa, vol, seed=1)
    for m in members:
        write_random(sa, m, seed=hash(m) & 0xFFFF)

    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL)
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
    # idempotent: the same call again is OK
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL)

    wait_synced_after(lab, vol, [vol])
    wait_synced_after(lab, gid, members)
    info = A.call("GetVolumeReplicationInfo", volume_id=vol)
    rep = last_report(sa, vol)
    assert info.status == info.HEALTHY, info.status_message
    assert info.last_sync_time.seconds > 0
    # what GetVolumeReplicationInfo says is what the last sync shipped
    ctl_ok = abs(info.last_sync_time.ToNanoseconds() / 1e9 - rep["started_at"]) < 30
    assert ctl_ok and info.last_sync_bytes > 0

    # scheduled syncs keep landing and ship only new changes
    written = write_random(sa, vol, count=8, seed=7)
    wait_synced_after(lab, vol, [vol])
    changed = sum(r["bytes_changed"] for r in find_state(sa.pool, vol).reports[-3:])
    assert written <= changed <= written + (1 << 20)

    # the replica is visible at B under the same id, and read-write use is refused there
    got = B.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol)).volume
    assert got.volume_id == vol
    grp = B.groups.ControllerGetVolumeGroup(volumegroup_pb2.ControllerGetVolumeGroupRequest(volume_group_id=gid))
    assert sorted(v.volume_id for v in grp.volume_group.volumes) == sorted(members)
    cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                                   access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
    code = code_of(lambda: B.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
        volume_id=vol, staging_target_path=str(lab.root / "stg-b"), volume_capability=cap)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    # on a secondary the seed's answer for GetVolumeReplicationInfo is FAILED_PRECONDITION
    assert code_of(lambda: B.call("GetVolumeReplicationInfo", volume_id=vol)) == grpc.StatusCode.FAILED_PRECONDITION


def _promote_logged(site, unit, what) -> bool:
    """The worker's log line for the unit's promote names *what* (its base's block maps)."""
    lines = [ln for log in site.run.run_dir.glob("*.log") for ln in log.read_text(errors="replace").splitlines()
             if f"promoted {unit} to primary" in ln]
    return bool(lines) and what in lines[-1]


def test_planned_failover_and_failback(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    gid, members = _group(A, "pf")
    for m in members:
        write_random(sa, m, seed=len(m))
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
    wait_synced_after(lab, gid, members)
    write_random(sa, members[0], count=4, seed=99)

    # promote without a demoted peer is refused
    assert code_of(lambda: B.call("PromoteVolume", group_id=gid)) == grpc.StatusCode.FAILED_PRECONDITION
    A.retry("DemoteVolume", group_id=gid)
    B.retry("PromoteVolume", group_id=gid)
    for m in members:
        assert image_sha(sa, m) == image_sha(sb, m)
    assert find_state(sb.pool, gid).epoch == find_state(sa.pool, gid).epoch + 1
    # B's receiver kept the replica's block maps: the promote read none of the data
    assert _promote_logged(sb, gid, "block maps from the replica maps")

    written = write_random(sb, members[1], count=5, seed=5)
    wait_synced_after(lab, gid, members, src="b", dst="a")
    # failback ships only what changed at B, not a full copy
    first = [r for r in find_state(sb.pool, gid).reports if r["bytes_changed"]][0]
    assert first["bytes_changed"] <= written + (256 << 10)
    assert first["bytes_on_wire"] < 4 * written

    B.retry("DemoteVolume", group_id=gid)
    A.retry("PromoteVolume", group_id=gid)
    for m in members:
        assert image_sha(sa, m) == image_sha(sb, m)
    write_random(sa, members[2], count=3, seed=3)
    wait_synced_after(lab, gid, members)


def test_forced_failover_split_brain_and_resync(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("fo", 64 << 20).volume_id
    write_random(sa, vol, seed=11)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL, sidecar=True)
    wait_synced_after(lab, vol, [vol])

    # site A is lost: its sshd and worker stop
    lab.stop_sshd("a")
    sa.run.stop("worker")
    B.retry("PromoteVolume", volume_id=vol, force=True, sidecar=True)
    write_random(sb, vol, count=6, seed=12)

    # A comes back still believing it is primary, and keeps writing: split brain
    write_random(sa, vol, count=6, seed=13)
    sa.run.start("worker")
    lab.start_sshd("a")
    wait_for(lambda: A.call("GetVolumeReplicationInfo", volume_id=vol).status
             == A.call("GetVolumeReplicationInfo", volume_id=vol).ERROR, 120, what="A to report the conflict")
    info = A.call("GetVolumeReplicationInfo", volume_id=vol)
    assert "split brain" in info.status_message

    # resync is refused until A is demoted
    assert code_of(lambda: A.call("ResyncVolume", volume_id=vol)) == grpc.StatusCode.FAILED_PRECONDITION
    A.retry("DemoteVolume", volume_id=vol)
    # without force the demoted site keeps its divergent writes (the controller
    # sends force = spec.autoResync, false by default): not ready, and A's image is left alone
    diverged = image_sha(sa, vol)
    assert A.retry("ResyncVolume", volume_id=vol).ready is False
    wait_attempts(sb, vol, 3)    # three of B's syncs: one that overwrote A would have landed
    assert A.retry("ResyncVolume", volume_id=vol).ready is False
    assert image_sha(sa, vol) == diverged
    # with force (Ramen's failover, or autoResync) the divergent blocks are discarded
    assert A.retry("ResyncVolume", volume_id=vol, force=True).ready is False
    wait_for(lambda: A.retry("ResyncVolume", volume_id=vol, force=True).ready, 60, what="resync to finish")
    assert image_sha(sa, vol) == image_sha(sb, vol)
    rep = last_report(sb, vol)
    compare = [r for r in find_state(sb.pool, vol).reports if r["mode"] == "compare"]
    assert compare and compare[-1]["bytes_changed"] < 4 << 20     # only divergent blocks, not 64 MiB
    assert rep["target_generation"] >= compare[-1]["target_generation"]


def test_a_forced_resync_is_shipped_now_not_at_the_primarys_next_slot(lab):
    """Failback after a forced failover: the returned site is demoted and resynced with force
    (Ramen's failover sequence: kubernetes-csi-addons internal/controller/replication.storage/
    volumereplication_controller.go resyncs the demoted side until it is ready). The new
    primary's next slot is up to an hour away, but the resync asks it for that sync now
    (the receiver's ``soon`` verb): the compare sync lands in seconds."""
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("fb-soon", 16 << 20).volume_id
    write_random(sa, vol, seed=21)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"}, sidecar=True)
    wait_for(lambda: generation(sb, vol) >= 1, 30, what="the initial copy")
    lab.stop_sshd("a")
    try:
        B.retry("PromoteVolume", volume_id=vol, force=True, sidecar=True)
        write_random(sb, vol, count=4, seed=22)
        write_random(sa, vol, count=4, seed=23)      # a's writes b never got: divergence
    finally:
        lab.start_sshd("a")
    A.retry("DemoteVolume", volume_id=vol)
    t0 = time.monotonic()
    wait_for(lambda: A.retry("ResyncVolume", volume_id=vol, force=True).ready, 45,
             what="the resync, long before the primary's hourly slot")
    took = time.monotonic() - t0
    assert image_sha(sa, vol) == image_sha(sb, vol)
    compare = [r for r in find_state(sb.pool, vol).reports if r["mode"] == "compare"]
    assert len(compare) == 1, (took, compare)


def _synced_at(client, vol) -> float:
    return client.call("GetVolumeReplicationInfo", volume_id=vol).last_sync_time.ToNanoseconds() / 1e9


def test_info_after_a_forced_promote_waits_for_this_terms_first_sync(lab):
    """A site that was primary before keeps the last sync of that term in its records. After a
    forced promote, GetVolumeReplicationInfo must not answer with it: the csi-addons controller
    copies the answer into the VolumeReplication's status.lastSyncTime
    (kubernetes-csi-addons internal/controller/replication.storage/volumereplication_controller.go,
    getVolumeReplicationInfo), and a time older than what the peer shipped since overstates how
    much this site lost. NOT_FOUND, the seed's answer before a first sync, until there is one."""
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("stale", 32 << 20).volume_id
    write_random(sa, vol, count=4, seed=31)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL, sidecar=True)
    wait_synced_after(lab, vol, [vol])
    # a term as primary at b, then back to a
    A.retry("DemoteVolume", volume_id=vol)
    B.retry("PromoteVolume", volume_id=vol)
    write_random(sb, vol, count=2, seed=32)
    wait_synced_after(lab, vol, [vol], src="b", dst="a")
    b_term = _synced_at(B, vol)
    B.retry("DemoteVolume", volume_id=vol)
    A.retry("PromoteVolume", volume_id=vol)
    write_random(sa, vol, count=2, seed=33)
    wait_synced_after(lab, vol, [vol])
    assert _synced_at(A, vol) > b_term

    # site a is lost; b takes over with force
    lab.stop_sshd("a")
    sa.run.stop("worker")
    B.retry("PromoteVolume", volume_id=vol, force=True, sidecar=True)
    promoted_at = time.time()
    assert code_of(lambda: B.call("GetVolumeReplicationInfo", volume_id=vol)) == grpc.StatusCode.NOT_FOUND

    # a returns, is demoted and resynced; b's first sync of its term is what Info then answers
    sa.run.start("worker")
    lab.start_sshd("a")
    A.retry("DemoteVolume", volume_id=vol)
    wait_for(lambda: A.retry("ResyncVolume", volume_id=vol, force=True).ready, 90, what="resync to finish")
    wait_for(lambda: code_of(lambda: B.call("GetVolumeReplicationInfo", volume_id=vol)) == grpc.StatusCode.OK,
             60, what="b's first sync after the forced promote")
    assert _synced_at(B, vol) >= promoted_at - 1


def test_concurrent_promote_and_demote_one_aborted(lab):
    A = lab.clients["a"]
    sa = lab.sites["a"]
    vol = A.create_volume("race", 128 << 20).volume_id
    A.retry("EnableVolumeReplication", volume_id=vol,
            parameters={"schedulingInterval": "1h", "bandwidthLimit": str(16 << 20)})
    wait_for(lambda: generation(sa, vol) >= 1, 60, what="initial sync")
    # 48 MiB of changes at 16 MiB/s: the demote's final sync holds the unit ~3 s
    write_random(sa, vol, count=48, size=1 << 20, seed=3)
    results = {}

    def call(method):
        try:
            A.call(method, volume_id=vol)
            results[method] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            results[method] = e.code()
    demote = threading.Thread(target=call, args=("DemoteVolume",))
    demote.start()
    wait_for(lambda: receiver_pids(lab.sites["b"].pool), 30, interval=0.02, what="the demote's final sync at b")
    call("PromoteVolume")
    demote.join()
    assert results["PromoteVolume"] == grpc.StatusCode.ABORTED, results
    # the demote finishes (or is joined by its retry) and the state is consistent
    A.retry("DemoteVolume", volume_id=vol)
    st = find_state(sa.pool, vol)
    assert st.role == "secondary" and st.demoted
    assert image_sha(sa, vol) == image_sha(lab.sites["b"], vol)


def test_sidecar_form_and_missing_source(lab):
    A = lab.clients["a"]
    vol = A.create_volume("side", 64 << 20).volume_id
    assert code_of(lambda: A.call("EnableVolumeReplication")) == grpc.StatusCode.INVALID_ARGUMENT
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL, sidecar=True)
    # the outcome is recorded just after the generation: wait for what the RPC reports
    # before the first sync the answer is NOT_FOUND (last_sync_time is REQUIRED), then OK
    wait_for(lambda: code_of(lambda: A.call("GetVolumeReplicationInfo", volume_id=vol)) == grpc.StatusCode.OK,
             30, what="initial sync recorded")
    a = A.call("GetVolumeReplicationInfo", volume_id=vol, sidecar=True)
    b = A.call("GetVolumeReplicationInfo", volume_id=vol)
    assert a.last_sync_time.seconds and b.last_sync_time.seconds
    assert code_of(lambda: A.call("GetVolumeReplicationInfo", volume_id="vol-missing", sidecar=True)) \
        == grpc.StatusCode.NOT_FOUND
    A.retry("DisableVolumeReplication", volume_id=vol, sidecar=True)
    assert code_of(lambda: A.call("GetVolumeReplicationInfo", volume_id=vol)) == grpc.StatusCode.FAILED_PRECONDITION
    # the peer's copy stays as a standalone volume
    B = lab.clients["b"]
    assert B.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol)).volume.volume_id == vol


def test_restarts_during_sync_lose_nothing(lab):
    A = lab.clients["a"]
    sa = lab.sites["a"]
    vol = A.create_volume("big", 512 << 20).volume_id
    write_random(sa, vol, count=160, size=1 << 20, seed=21)
    # a bandwidth limit stretches the initial sync to ~4 s so the kills land inside it
    A.retry("EnableVolumeReplication", volume_id=vol,
            parameters={**INTERVAL, "bandwidthLimit": str(40 << 20)})
    journal = lab.sites["b"].pool / "replication" / vol / "journal"
    # kill once the peer has journaled some records, so there is something to resume
    # (allocated bytes: a fresh member's staging image is sparse)
    wait_for(lambda: sum(f.stat().st_blocks * 512 for f in journal.rglob("*") if f.is_file()) > (8 << 20)
             if journal.exists() else 0,
             60, interval=0.05, what="the peer to journal records")
    assert generation(sa, vol) == 0, "the sync finished before the kill"
    sa.run.stop("worker", sig=9)          # kill -9 mid-sync: acks_late redelivers it
    lab.restart_redis("a")
    sa.run.stop("scheduler")
    sa.run.start("worker")
    sa.run.start("scheduler")
    wait_synced_after(lab, vol, [vol], timeout=150)
    reports = find_state(sa.pool, vol).reports
    assert reports[0]["resumed"], "the interrupted transfer restarted from zero"
    info = A.call("GetVolumeReplicationInfo", volume_id=vol)
    assert info.status == info.HEALTHY, info.status_message
