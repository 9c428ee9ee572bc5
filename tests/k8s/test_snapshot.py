"""A VolumeSnapshot taken at a is usable at b after the failover: drsvc ships a snapshot of
a replicated volume with the next sync and answers it at the peer under the same id
(README, "Recovery points"), so b pre-provisions a VolumeSnapshotContent with that handle
and restores a PVC from it. Callers: external-snapshotter pkg/sidecar-controller/snapshot_controller.go
(CreateSnapshot at a; ListSnapshots by id for b's pre-provisioned content),
pkg/common-controller/snapshot_controller.go (binding), external-provisioner
pkg/controller/controller.go (CreateVolume from a snapshot source)."""
from __future__ import annotations

import hashlib

import pytest

from drsvc.layout import PoolLayout

from . import dr

pytestmark = pytest.mark.k8s

SRC, SNAP, RESTORED = "snap-src", "snap-1", "snap-restored"
SNAP_API = "snapshot.storage.k8s.io/v1"


def snapshot(name: str, source: dict) -> dict:
    return {"apiVersion": SNAP_API, "kind": "VolumeSnapshot", "metadata": {"name": name, "namespace": dr.NS},
            "spec": {"volumeSnapshotClassName": "drsvc", "source": source}}


def ready(site, name: str):
    vs = site.api.get("VolumeSnapshot", name, dr.NS)
    return vs if vs and vs.get("status", {}).get("readyToUse") else None


def file_sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def test_snapshot_at_a_restores_at_b_after_failover(sites, timings):
    sa, sb = sites["a"], sites["b"]
    vol, _ = dr.setup_pair(sa, sb, SRC, timings)
    dr.write(sa, vol, 4 * dr.MiB, dr.MiB, seed=40)
    sa.api.create(snapshot(SNAP, {"persistentVolumeClaimName": SRC}))
    vs, secs = sa.api.wait("a: VolumeSnapshot ready", lambda: ready(sa, SNAP), 60)
    timings["a: VolumeSnapshot created -> readyToUse"] = secs
    content = sa.api.get("VolumeSnapshotContent", vs["status"]["boundVolumeSnapshotContentName"])
    snap_id = content["status"]["snapshotHandle"]
    at_a = file_sha(PoolLayout(sa.lab_site.pool).snapshot_image(snap_id))
    dr.write(sa, vol, 4 * dr.MiB, dr.MiB, seed=41)        # the volume moves on past the snapshot

    dr.planned_failover(sa, sb, SRC)
    sb.api.create({"apiVersion": SNAP_API, "kind": "VolumeSnapshotContent", "metadata": {"name": f"{SNAP}-from-a"},
                   "spec": {"deletionPolicy": "Retain", "driver": "csi.drsvc.io", "volumeSnapshotClassName": "drsvc",
                            "source": {"snapshotHandle": snap_id},
                            "volumeSnapshotRef": {"name": SNAP, "namespace": dr.NS}}})
    sb.api.create(snapshot(SNAP, {"volumeSnapshotContentName": f"{SNAP}-from-a"}))
    sb.api.wait("b: pre-provisioned VolumeSnapshot ready", lambda: ready(sb, SNAP), 60)
    sb.api.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": RESTORED, "namespace": dr.NS,
                                "annotations": {dr.SELECTED_NODE: sb.node}},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "drsvc",
                            "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                                           "name": SNAP},
                            "resources": {"requests": {"storage": dr.SIZE}}}})
    pv, secs = dr.wait_bound(sb, RESTORED)
    timings["b: PVC from the snapshot Bound"] = secs
    assert dr.sha(sb, dr.handle(pv)) == at_a
    assert dr.sha(sb, dr.handle(pv)) != dr.sha(sb, vol)
