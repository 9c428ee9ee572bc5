"""The DR objects as Ramen's VolumeReplicationGroup drives them (internal/controller/vrg_volrep.go
of RamenDR/ramen): PVCs, VolumeReplications with a PVC as data source, the PV and PVC a
secondary restores statically, and the checks Ramen makes of a VR's status (a condition
counts only at the VR's current generation: isVRConditionMet)."""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from datetime import datetime

from drsvc.layout import PoolLayout

from .world import K8sSite

NS = "default"
VR = "VolumeReplication"
VGR = "VolumeGroupReplication"
MiB = 1 << 20
CLASS = "drsvc-30s"           # deploy/base/classes.yaml's, schedulingInterval 30s (world.fast_class)
GROUP_CLASS = "drsvc-group-30s"
SIZE = "64Mi"
SELECTED_NODE = "volume.kubernetes.io/selected-node"


# -- volumes ------------------------------------------------------------------------
def create_pvc(site: K8sSite, name: str, labels: dict | None = None, size: str = SIZE) -> dict:
    """A PVC of the shipped StorageClass (WaitForFirstConsumer): the node annotation is
    what the scheduler would add for the first pod using it."""
    return site.api.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                            "metadata": {"name": name, "namespace": NS, "labels": labels or {},
                                         "annotations": {SELECTED_NODE: site.node}},
                            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "drsvc",
                                     "resources": {"requests": {"storage": size}}}})


def wait_bound(site: K8sSite, name: str, timeout: float = 60) -> tuple[dict, float]:
    """(the PV bound to PVC *name*, seconds to Bound)."""
    pvc, secs = site.api.wait(f"{site.name}: PVC {name} Bound", lambda: _bound(site, name), timeout)
    return site.api.get("PersistentVolume", pvc["spec"]["volumeName"]), secs


def _bound(site: K8sSite, name: str):
    pvc = site.api.get("PersistentVolumeClaim", name, NS)
    return pvc if pvc and pvc.get("status", {}).get("phase") == "Bound" else None


def handle(pv: dict) -> str:
    return pv["spec"]["csi"]["volumeHandle"]


def restore_pv_pvc(site: K8sSite, name: str, pv: dict, labels: dict | None = None) -> None:
    """The PV and PVC of the primary's volume, as Ramen restores them at the other
    cluster: the PV's spec with a claimRef to the PVC (no uid), the PVC naming the PV."""
    spec = {k: v for k, v in pv["spec"].items() if k not in ("claimRef", "nodeAffinity")}
    spec["claimRef"] = {"kind": "PersistentVolumeClaim", "namespace": NS, "name": name, "apiVersion": "v1"}
    spec["persistentVolumeReclaimPolicy"] = "Retain"
    site.api.create({"apiVersion": "v1", "kind": "PersistentVolume",
                     "metadata": {"name": pv["metadata"]["name"]}, "spec": spec})
    site.api.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
                     "spec": {"accessModes": pv["spec"]["accessModes"], "storageClassName": "drsvc",
                              "volumeName": pv["metadata"]["name"],
                              "resources": {"requests": {"storage": pv["spec"]["capacity"]["storage"]}}}})


def image(site: K8sSite, volume_id: str):
    return PoolLayout(site.lab_site.pool).image(volume_id)


def write(site: K8sSite, volume_id: str, offset: int, size: int, seed: int) -> bytes:
    """Bytes written into the volume's image file directly (no kubelet mounts anything here)."""
    data = hashlib.sha256(f"{seed}".encode()).digest() * (size // 32)
    with open(image(site, volume_id), "r+b") as f:
        f.seek(offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def sha(site: K8sSite, volume_id: str) -> str:
    h = hashlib.sha256()
    with open(image(site, volume_id), "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# -- replication objects ------------------------------------------------------------
def create_vr(site: K8sSite, name: str, state: str, auto_resync: bool = False, cls: str = CLASS) -> dict:
    """A VolumeReplication of PVC *name* (Ramen's createVR: same name as the PVC)."""
    return site.api.create({"apiVersion": "replication.storage.openshift.io/v1alpha1", "kind": "VolumeReplication",
                            "metadata": {"name": name, "namespace": NS},
                            "spec": {"volumeReplicationClass": cls, "replicationState": state,
                                     "autoResync": auto_resync,
                                     "dataSource": {"apiGroup": "", "kind": "PersistentVolumeClaim", "name": name}}})


def create_vgr(site: K8sSite, name: str, state: str, selector: dict, auto_resync: bool = False,
               content: str | None = None) -> dict:
    """A VolumeGroupReplication of the PVCs labelled *selector*; *content* names a
    pre-provisioned VolumeGroupReplicationContent (the secondary's)."""
    spec = {"volumeGroupReplicationClassName": GROUP_CLASS, "volumeReplicationClassName": CLASS,
            "replicationState": state, "autoResync": auto_resync, "source": {"selector": {"matchLabels": selector}}}
    if content:
        spec["volumeGroupReplicationContentName"] = content
    return site.api.create({"apiVersion": "replication.storage.openshift.io/v1alpha1",
                            "kind": "VolumeGroupReplication", "metadata": {"name": name, "namespace": NS},
                            "spec": spec})


def set_state(site: K8sSite, kind: str, name: str, state: str, auto_resync: bool = False) -> int:
    """Ramen's updateVR: the state and autoResync changed together; returns the new generation."""
    doc = site.api.patch(kind, name, NS, {"spec": {"replicationState": state, "autoResync": auto_resync}})
    return doc["metadata"]["generation"]


def conditions(obj: dict) -> dict:
    """{type: (status, reason)} of the conditions at the object's current generation."""
    gen = obj["metadata"]["generation"]
    return {c["type"]: (c["status"], c["reason"]) for c in obj.get("status", {}).get("conditions", [])
            if c.get("observedGeneration") == gen}


@dataclass
class Reached:
    obj: dict
    seconds: float

    @property
    def status(self) -> dict:
        return self.obj.get("status", {})


STATE = {"primary": "Primary", "secondary": "Secondary"}


def wait_state(site: K8sSite, kind: str, name: str, state: str, *, t0: float | None = None,
               timeout: float = 180, seen: list | None = None) -> Reached:
    """Until the controller reports *state* Completed at the current generation, with
    Degraded and Resyncing false (Ramen's checkVRStatus for a primary, and for a
    secondary whose resync is done); seconds counted from *t0* (the spec change). Each
    distinct set of conditions met on the way is appended to *seen*."""
    t0 = time.monotonic() if t0 is None else t0
    seen = [] if seen is None else seen

    def done():
        obj = site.api.get(kind, name, NS)
        c = conditions(obj) if obj else {}
        if c and (not seen or seen[-1] != c):
            seen.append(c)
        ok = (obj and obj.get("status", {}).get("state") == STATE[state] and c.get("Completed", ("",))[0] == "True"
              and c.get("Degraded", ("",))[0] == "False" and c.get("Resyncing", ("",))[0] == "False")
        return obj if ok else None
    obj, _ = site.api.wait(f"{site.name}: {kind} {name} {state} Completed", done, timeout, interval=0.02)
    return Reached(obj, time.monotonic() - t0)


# -- the checks and steps of the flow ------------------------------------------------
def ts(value: str | None) -> float:
    """A status time (RFC 3339) as seconds since the epoch; 0 when absent."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else 0.0


def expect(obj: dict, **want) -> dict:
    """The conditions at the current generation are *want* ({type: (status, reason)})."""
    got = conditions(obj)
    for kind, sr in want.items():
        assert got.get(kind) == sr, f"{obj['metadata']['name']}: {kind} is {got.get(kind)}, not {sr}: {got}"
    return got


def wait_equal(sa, sb, vol: str, timeout: float = 120) -> None:
    sa.api.wait(f"{vol} equal at a and b", lambda: image(sb, vol).exists() and sha(sa, vol) == sha(sb, vol),
                timeout, interval=0.5)


def wait_sync_after(site, name: str, after: float, kind: str = VR, timeout: float = 150) -> dict:
    """The VR's status once it shows a sync later than *after* (epoch seconds): the
    controller asks for it every schedulingInterval (< 2 min: not halved)."""
    def synced():
        obj = site.api.get(kind, name, NS)
        st = obj.get("status", {})
        return st if ts(st.get("lastSyncTime")) > after else None
    st, _ = site.api.wait(f"{site.name}: {name} synced after {after}", synced, timeout, interval=0.5)
    return st


def planned_failover(src, dst, name: str, kind: str = VR) -> tuple[float, float]:
    """Ramen's planned failover: the source's VR to secondary (its final sync ships what
    was written), then the destination's to primary. Returns both times to Completed."""
    t0 = time.monotonic()
    set_state(src, kind, name, "secondary")
    demoted = wait_state(src, kind, name, "secondary", t0=t0)
    expect(demoted.obj, Completed=("True", "Demoted"), Degraded=("False", "Healthy"))
    t1 = time.monotonic()
    set_state(dst, kind, name, "primary")
    promoted = wait_state(dst, kind, name, "primary", t0=t1)
    expect(promoted.obj, Completed=("True", "Promoted"), Degraded=("False", "Healthy"))
    return demoted.seconds, promoted.seconds


def setup_pair(sa: K8sSite, sb: K8sSite, name: str, timings: dict, labels: dict | None = None) -> tuple[str, dict]:
    """PVC *name* at a, written, under a VR primary; its PV and PVC restored at b under a
    VR secondary. Returns (volume handle, a's PV)."""
    create_pvc(sa, name, labels)
    pv, bound = wait_bound(sa, name)
    vol = handle(pv)
    write(sa, vol, 0, 4 * MiB, seed=1)
    t0 = time.monotonic()
    create_vr(sa, name, "primary")
    done = wait_state(sa, VR, name, "primary", t0=t0)
    expect(done.obj, Completed=("True", "Promoted"), Degraded=("False", "Healthy"), Resyncing=("False", "NotResyncing"))
    timings.setdefault("a: PVC Bound (CreateVolume)", bound)
    timings.setdefault("a: VR created -> Primary Completed (Enable + Promote)", done.seconds)
    wait_equal(sa, sb, vol)
    st = wait_sync_after(sa, name, 0)
    assert st.get("lastSyncDuration") and st.get("lastSyncBytes", 0) > 0, st

    restore_pv_pvc(sb, name, pv, labels)
    wait_bound(sb, name)
    t0 = time.monotonic()
    create_vr(sb, name, "secondary")
    done = wait_state(sb, VR, name, "secondary", t0=t0)
    expect(done.obj, Completed=("True", "Demoted"), Degraded=("False", "Healthy"), Resyncing=("False", "NotResyncing"))
    assert "lastSyncTime" not in done.status      # the controller keeps no sync time on a secondary
    timings.setdefault("b: VR created -> Secondary Completed", done.seconds)
    return vol, pv
