"""A VolumeGroupReplication of two PVCs carried through a planned failover: at a the
group is made by the controllers (VolumeGroupReplication -> VolumeGroupReplicationContent
-> CreateVolumeGroup, then a VolumeReplication of the group); at b the content is
pre-provisioned with a's group handle, as a DR orchestrator restores it (Ramen:
internal/controller/vrg_volgrouprep.go), and its VolumeGroupReplication names it.
Controllers: kubernetes-csi-addons internal/controller/replication.storage/
volumegroupreplication_controller.go and volumegroupreplicationcontent_controller.go."""
from __future__ import annotations

import time

import pytest

from . import dr

pytestmark = pytest.mark.k8s

GROUP = "grp-1"
LABELS = {"drsvc.io/k8s-group": GROUP}
MEMBERS = ("grp-1-m1", "grp-1-m2")


def make_primary_group(sa, timings) -> dict:
    """The members at a, written, then the group primary; returns {pvc: PV}."""
    pvs = {}
    for i, name in enumerate(MEMBERS):
        dr.create_pvc(sa, name, LABELS)
        pvs[name], _ = dr.wait_bound(sa, name)
        dr.write(sa, dr.handle(pvs[name]), 0, 2 * dr.MiB, seed=20 + i)
    t0 = time.monotonic()
    dr.create_vgr(sa, GROUP, "primary", LABELS)
    done = dr.wait_state(sa, dr.VGR, GROUP, "primary", t0=t0)
    dr.expect(done.obj, Completed=("True", "Promoted"), Degraded=("False", "Healthy"))
    timings["a: VGR created -> Primary Completed (CreateVolumeGroup, Enable, Promote)"] = done.seconds
    return pvs


def restore_secondary_group(sa, sb, pvs: dict, timings) -> None:
    """At b: the members' PVs and PVCs, the content with a's group handle, the group secondary."""
    content = sa.api.get("VolumeGroupReplicationContent", sa.api.get(dr.VGR, GROUP, dr.NS)["spec"]
                         ["volumeGroupReplicationContentName"])
    for name, pv in pvs.items():
        dr.restore_pv_pvc(sb, name, pv, LABELS)
        dr.wait_bound(sb, name)
    sb.api.create({"apiVersion": "replication.storage.openshift.io/v1alpha1", "kind": "VolumeGroupReplicationContent",
                   "metadata": {"name": content["metadata"]["name"]},
                   "spec": {"volumeGroupReplicationHandle": content["spec"]["volumeGroupReplicationHandle"],
                            "provisioner": "csi.drsvc.io", "volumeGroupReplicationClassName": dr.GROUP_CLASS,
                            "source": {"volumeHandles": content["spec"]["source"]["volumeHandles"]}}})
    t0 = time.monotonic()
    dr.create_vgr(sb, GROUP, "secondary", LABELS, content=content["metadata"]["name"])
    done = dr.wait_state(sb, dr.VGR, GROUP, "secondary", t0=t0)
    dr.expect(done.obj, Completed=("True", "Demoted"), Degraded=("False", "Healthy"))
    timings["b: VGR created -> Secondary Completed"] = done.seconds


def test_group_planned_failover(sites, timings, k8s_world):
    """Both members written at a just before the demote are at b after the promote."""
    sa, sb = sites["a"], sites["b"]
    pvs = make_primary_group(sa, timings)
    vols = [dr.handle(pv) for pv in pvs.values()]
    for v in vols:
        dr.wait_equal(sa, sb, v)
    restore_secondary_group(sa, sb, pvs, timings)
    for i, v in enumerate(vols):
        dr.write(sa, v, 4 * dr.MiB, dr.MiB, seed=30 + i)
    demote, promote = dr.planned_failover(sa, sb, GROUP, kind=dr.VGR)
    for v in vols:
        assert dr.sha(sa, v) == dr.sha(sb, v)
    timings["planned failover, group of 2: demote at a -> Completed"] = demote
    timings["planned failover, group of 2: promote at b -> Completed"] = promote
    timings["planned failover, group of 2, through Kubernetes"] = demote + promote
    timings["b: manager's Reconciler errors on the group's content"] = sb.cluster.count(
        "csi-addons-manager", "Reconciler error", "VolumeGroupReplicationContent")
