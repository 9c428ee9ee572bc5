"""On a real two-site lab: recovery points at the DR site.

Everything goes through the plugins' gRPC (CSI, CSI-Addons Replication, drsvc Admin), with
real filesystems mounted through NodeStage/NodePublish. Syncs are requested (SyncNow) so
every generation is one the test knows; the schedule is an hour."""
from __future__ import annotations

import hashlib
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from drsvc.layout import PoolLayout
from drsvc.replication.receiver import wait_for_applies
from csi_plugin.gen import csi_pb2, csi_pb2_grpc, volumegroup_pb2
from drsvc_lab import Lab
from drsvc_cli.client import DrClient, RpcFailed
from tests.dr.helpers import code_of, wait_for
from tests.faults.steps import file_sha
from tests.fixtures.sites import Client, image_sha, need_lab

HOUR = {"schedulingInterval": "1h"}
RP = "drsvc.io/recoveryPoint"


@pytest.fixture(scope="module")
def plab():
    """One lab for the module: each test works on volumes of its own."""
    need_lab()
    root = Path(tempfile.mkdtemp(prefix="drsvc-points-"))
    lab = Lab(root).build()
    lab.up()
    lab.clients = {n: Client(s) for n, s in lab.sites.items()}
    lab.dr = {n: DrClient(s.endpoint) for n, s in lab.sites.items()}
    try:
        yield lab
    finally:
        for c in [*lab.clients.values(), *lab.dr.values()]:
            c.close()
        lab.teardown()


def sha_files(root: Path, names) -> dict:
    return {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names}


class Mounted:
    """A volume staged and published read-write at a site, under the test's tmp dir."""

    def __init__(self, client: DrClient, vid: str, where: Path):
        self.client, self.vid = client, vid
        self.stg, self.mnt = where / f"stg-{vid}", where / f"mnt-{vid}"

    def __enter__(self) -> Path:
        self.client.until_done(lambda: self.client.mount(self.vid, str(self.stg), str(self.mnt)), wait=60)
        return self.mnt

    def __exit__(self, *exc):
        self.client.until_done(lambda: self.client.unmount(self.vid, str(self.stg), str(self.mnt)), wait=60)


def enable(client: DrClient, params=None, **unit):
    client.until_done(lambda: client.replication("EnableVolumeReplication", **unit,
                                                 parameters={**HOUR, **(params or {})}), wait=60)
    wait_for(lambda: client.status(**unit)["generation"] >= 1, 90, what="the initial sync")


def sync(client: DrClient, **unit) -> int:
    r = client.until_done(lambda: client.sync_now(**unit, wait=60), wait=90)
    assert not r["skipped"], r
    return r["target_generation"]


def points(client: DrClient, **unit) -> list[dict]:
    return client.recovery_points(**unit)["points"]


# -- ransomware: promote at the point before the corruption; drill a newer one; fail back ------
def test_ransomware_promote_to_the_point_before_it_then_fail_back(plab, tmp_path):
    a, b = plab.dr["a"], plab.dr["b"]
    vid = a.create_volume("ransom", 64 << 20)["volume_id"]
    unit = {"volume_id": vid}
    rnd = random.Random(21)
    names = [f"f{i:02d}.bin" for i in range(20)]
    with Mounted(a, vid, tmp_path) as mnt:
        for n in names:
            (mnt / n).write_bytes(rnd.randbytes(rnd.randrange(50_000, 400_000)))
        os.sync()
        before = sha_files(mnt, names)
        enable(a, **unit)
        p = sync(a, **unit)                      # point P: the files before the corruption
        assert points(b, **unit)[-1]["generation"] == p
        for n in names[::2]:                     # "encrypted" in place: half the files overwritten
            with open(mnt / n, "r+b") as f:
                f.write(rnd.randbytes(os.fstat(f.fileno()).st_size))
        os.sync()
        corrupted = sha_files(mnt, names)
        later = [sync(a, **unit), sync(a, **unit)]

    listed = points(b, **unit)
    assert [x["generation"] for x in listed][-3:] == [p, *later]
    assert set(listed[-1]) == {"generation", "time", "kind", "pinned", "unique_bytes", "total_bytes"}
    assert listed[-3]["unique_bytes"] >= 10 * 50_000     # P keeps what the encryption overwrote

    # a is still up, still primary (and still infected): b takes over by force, at P
    t = time.monotonic()
    b.until_done(lambda: b.replication("PromoteVolume", force=True, parameters={RP: str(p)}, **unit), wait=120)
    promote_s = time.monotonic() - t
    assert b.status(**unit)["role"] == "primary"
    with Mounted(b, vid, tmp_path / "b") as mnt:
        assert sha_files(mnt, names) == before, "b's files are not the ones from before the corruption"

    # the newer points stay listed, pinned for a day, and a drill of one shows the corruption
    after = {x["generation"]: x for x in points(b, **unit)}
    assert all(after[g]["pinned"] for g in later)
    drill = b.clone_replica("inspect", point=str(later[-1]), **unit)
    assert drill["generation"] == later[-1]
    (cid,) = [v["volume_id"] for v in drill["volumes"]]
    with Mounted(b, cid, tmp_path / "drill") as mnt:
        assert sha_files(mnt, names) == corrupted
    b.delete_volume(cid)

    # fail back: a is demoted (fenced, so diverged); without force its data stays; with
    # force b's next sync is a compare sync that ships only what differs
    a.until_done(lambda: a.replication("DemoteVolume", **unit), wait=120)
    assert a.replication("ResyncVolume", force=False, **unit).ready is False
    a_image = image_sha(plab.sites["a"], vid)
    assert image_sha(plab.sites["a"], vid) == a_image            # nothing discarded unasked
    a.until_done(lambda: a.replication("ResyncVolume", force=True, **unit), wait=60)
    r = sync(b, **unit)
    rep = _last_report(plab.sites["b"], vid)
    assert rep["mode"] == "compare" and rep["target_generation"] == r
    assert 0 < rep["bytes_changed"] < 16 << 20, rep        # the divergence, not the 64 MiB volume
    assert image_sha(plab.sites["a"], vid) == image_sha(plab.sites["b"], vid)
    print(f"promote to a point: {promote_s:.3f}s (PromoteVolume round trip); failback shipped "
          f"{rep['bytes_changed']} bytes")


def _last_report(site, unit_id) -> dict:
    from drsvc.replication.common.unit_state import find_state
    return find_state(site.pool, unit_id).reports[-1]


# -- a group promoted to a point keeps the cross-volume write order ---------------------------
def test_group_promoted_to_a_point_keeps_the_write_order(plab, tmp_path):
    A = plab.clients["a"]
    a, b = plab.dr["a"], plab.dr["b"]
    g = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="ordered")).volume_group
    gid = g.volume_group_id
    vids = [A.create_volume(f"ordered-{i}", 32 << 20, volumeGroup=gid).volume_id for i in range(3)]
    unit = {"group_id": gid}
    mounts = [Mounted(a, v, tmp_path) for v in vids]
    roots = [m.__enter__() for m in mounts]
    stop = threading.Event()
    done = []

    def writer():
        """Dependent writes: round r lands on volume 0, then 1, then 2, each made durable
        before the next, so any consistent cut has seq0 >= seq1 >= seq2 >= seq0 - 1."""
        r = 0
        while not stop.is_set():
            r += 1
            for root in roots:
                with open(root / "seq", "w") as f:
                    f.write(str(r))
                    f.flush()
                    os.fsync(f.fileno())
        done.append(r)
    try:
        for root in roots:
            (root / "seq").write_text("0")
        os.sync()
        enable(a, **unit)
        th = threading.Thread(target=writer)
        th.start()
        try:
            gens = [sync(a, **unit) for _ in range(4)]
        finally:
            stop.set()
            th.join()
    finally:
        for m in mounts:
            m.__exit__()
    assert done and done[0] > 0
    listed = [x["generation"] for x in points(b, **unit)]
    assert set(gens) <= set(listed)
    target = gens[1]
    b.until_done(lambda: b.replication("PromoteVolume", force=True, parameters={RP: str(target)}, **unit),
                 wait=120)
    seqs = []
    for i, v in enumerate(vids):
        with Mounted(b, v, tmp_path / f"b{i}") as mnt:
            seqs.append(int((mnt / "seq").read_text() or 0))
    assert seqs[0] >= seqs[1] >= seqs[2] >= seqs[0] - 1, seqs
    assert seqs[0] > 0, seqs


# -- CSI snapshots at the peer --------------------------------------------------------------
def test_csi_snapshots_appear_at_the_peer_restore_there_and_go_with_the_origin(plab):
    """The DR cluster pre-provisions a VolumeSnapshotContent with the snapshot's handle: the
    csi-snapshotter then reads it with ListSnapshots(snapshot_id=handle) and needs ready_to_use
    and creation_time (kubernetes-csi/external-snapshotter pkg/snapshotter/snapshotter.go,
    GetSnapshotStatus; called for a content whose source is a snapshotHandle); a restore is a
    CreateVolume whose content source is that snapshot id (external-provisioner)."""
    A, B = plab.clients["a"], plab.clients["b"]
    a, b = plab.dr["a"], plab.dr["b"]
    sa, sb = plab.sites["a"], plab.sites["b"]
    vid = a.create_volume("snapped", 32 << 20)["volume_id"]
    unit = {"volume_id": vid}
    _write(sa, vid, b"before the snapshot", 1)
    enable(a, **unit)
    snap = A.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name="nightly", source_volume_id=vid)).snapshot
    snap_sha = file_sha(sa.pool / "snapshots" / f"{snap.snapshot_id}.img")
    _write(sa, vid, b"after the snapshot", 2)
    sync(a, **unit)          # ships the snapshot as a generation, then the live data
    # b records the snapshot as it applies, a moment after its answer; the csi-snapshotter
    # reads the content again until it is ready to use
    wait_for_applies(PoolLayout(sb.pool))

    got = B.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=snap.snapshot_id)).entries
    assert len(got) == 1
    s = got[0].snapshot
    assert s.ready_to_use and s.source_volume_id == vid
    assert s.creation_time.seconds == snap.creation_time.seconds
    assert B.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)).snapshot.ready_to_use
    kinds = {x["kind"]: x for x in points(b, **unit)}
    assert kinds[f"snapshot:{snap.snapshot_id}"]["pinned"]
    assert image_sha(sa, vid) == image_sha(sb, vid)          # the live data followed

    # restore at b from the snapshot id, as from a pre-provisioned VolumeSnapshotContent
    cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                                   access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
    src = csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(
        snapshot_id=snap.snapshot_id))
    restored = B.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="restored-nightly", capacity_range=csi_pb2.CapacityRange(required_bytes=32 << 20),
        volume_capabilities=[cap], volume_content_source=src)).volume
    assert file_sha(sb.pool / "images" / f"{restored.volume_id}.img") == snap_sha

    # deleted at the origin: gone at the peer after the next sync; its point is no longer pinned
    A.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    sync(a, **unit)
    assert not B.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=snap.snapshot_id)).entries
    assert code_of(lambda: B.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id))) \
        == grpc.StatusCode.NOT_FOUND
    assert not any(x["pinned"] for x in points(b, **unit) if x["kind"] == f"snapshot:{snap.snapshot_id}")


def test_group_snapshots_appear_at_the_peer(plab):
    A, B = plab.clients["a"], plab.clients["b"]
    a, b = plab.dr["a"], plab.dr["b"]
    g = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="gsnapped")).volume_group
    gid = g.volume_group_id
    vids = [A.create_volume(f"gsnapped-{i}", 16 << 20, volumeGroup=gid).volume_id for i in range(2)]
    for i, v in enumerate(vids):
        _write(plab.sites["a"], v, b"group member", i)
    enable(a, group_id=gid)
    gc = csi_pb2_grpc.GroupControllerStub(A.channel)
    gs = gc.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="gnightly", source_volume_ids=vids), timeout=120).group_snapshot
    sync(a, group_id=gid)
    got = csi_pb2_grpc.GroupControllerStub(B.channel).GetVolumeGroupSnapshot(
        csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id=gs.group_snapshot_id)).group_snapshot
    assert got.ready_to_use and sorted(s.snapshot_id for s in got.snapshots) == \
        sorted(s.snapshot_id for s in gs.snapshots)
    assert any(x["kind"] == f"group-snapshot:{gs.group_snapshot_id}" and x["pinned"]
               for x in points(b, group_id=gid))


def _write(site, vid, data: bytes, block: int) -> None:
    with open(site.pool / "images" / f"{vid}.img", "r+b") as f:
        f.seek(block * (1 << 20))
        f.write(data * 1000)
        f.flush()
        os.fsync(f.fileno())


# -- input checks, listing for machines, metrics ----------------------------------------------
def test_bad_grid_and_bad_point_are_refused_by_name(plab):
    a, b = plab.dr["a"], plab.dr["b"]
    vid = a.create_volume("refusals", 16 << 20)["volume_id"]
    with pytest.raises(RpcFailed) as e:
        a.replication("EnableVolumeReplication", volume_id=vid,
                      parameters={**HOUR, "drsvc.io/retention": "1x1h(keep=all) | 24x1h | x1d"})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'x1d'" in e.value.message
    enable(a, {"drsvc.io/retention": "1x1h(keep=all) | 24x1h"}, volume_id=vid)
    assert b.recovery_points(volume_id=vid)["retention"] == "1x1h(keep=all) | 24x1h"
    for bad, code in (("yesterday", grpc.StatusCode.INVALID_ARGUMENT), ("2026-01-01T00:00:00", grpc.StatusCode.INVALID_ARGUMENT),
                      ("999", grpc.StatusCode.NOT_FOUND), ("1999-01-01T00:00:00Z", grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(RpcFailed) as e:
            b.replication("PromoteVolume", volume_id=vid, force=True, parameters={RP: bad})
        assert e.value.code == code, (bad, e.value)
    assert b.status(volume_id=vid)["role"] == "secondary"       # nothing changed


def test_points_cli_json_and_metrics(plab, capsys):
    import re
    import urllib.request

    from drsvc_cli.main import main
    a = plab.dr["a"]
    sb = plab.sites["b"]
    vid = a.create_volume("listed", 16 << 20)["volume_id"]
    enable(a, volume_id=vid)
    sync(a, volume_id=vid)
    capsys.readouterr()
    assert main(["points", "--json", "--config", str(sb.config_path), "--volume", vid]) == 0
    import json
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and len(out["result"]) >= 2
    for x in out["result"]:
        assert set(x) == {"generation", "time", "kind", "pinned", "unique_bytes", "total_bytes"}
        assert x["time"].endswith("Z") and x["kind"] == "scheduled" and x["total_bytes"] == 16 << 20
    assert main(["points", "--config", str(sb.config_path), "--volume", vid]) == 0
    assert "replica" in capsys.readouterr().out
    text = urllib.request.urlopen(f"http://127.0.0.1:{sb.cfg.metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^drsvc_replication_points{{[^}}]*unit="{vid}"[^}}]*}} (\S+)$', text, re.M)
    assert m and float(m.group(1)) >= 2
    assert re.search(rf'^drsvc_replication_dr_bytes{{[^}}]*unit="{vid}"[^}}]*}} (\S+)$', text, re.M)
