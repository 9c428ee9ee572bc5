"""A PV copied to the peer can be scheduled there.

external-provisioner (pkg/controller/topology.go, with --strict-topology as deploy/
runs it) writes the CreateVolume response's accessible_topology into the PV's node
affinity; Ramen restores that PV at the peer with only the handle changed (the id is
the same there). The PV is schedulable at the peer when the peer's storage node, as
NodeGetInfo advertises it, satisfies every segment of that affinity.
"""
from __future__ import annotations

from csi_plugin.gen import csi_pb2
from drsvc.volumes import TOPOLOGY_ZONE
from tests.dr.helpers import wait_for

CLASS = {"schedulingInterval": "2s"}


def _node_topology(client) -> dict:
    return dict(client.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30).accessible_topology.segments)


def _satisfies(node: dict, affinity: list[dict]) -> bool:
    """Kubernetes node affinity from CSI topology: any term whose every key matches."""
    return any(all(node.get(k) == v for k, v in term.items()) for term in affinity)


def test_pv_from_site_a_schedules_at_site_b(lab):
    A, B = lab.clients["a"], lab.clients["b"]
    vol = A.create_volume("topo", 64 << 20)
    affinity = [dict(t.segments) for t in vol.accessible_topology]
    assert affinity and all(TOPOLOGY_ZONE in t for t in affinity), affinity
    node_a, node_b = _node_topology(A), _node_topology(B)
    assert _satisfies(node_a, affinity)
    assert _satisfies(node_b, affinity), f"PV affinity {affinity} does not match site b's node {node_b}"
    # the replica's own record at b agrees with the PV copied from a
    A.retry("EnableVolumeReplication", volume_id=vol.volume_id, parameters=CLASS)
    replica = wait_for(lambda: next((e.volume for e in B.controller.ListVolumes(
        csi_pb2.ListVolumesRequest(), timeout=30).entries if e.volume.volume_id == vol.volume_id), None),
        60, what="the replica listed at b")
    assert [dict(t.segments) for t in replica.accessible_topology] == affinity
    # a volume created at b directly is schedulable at a as well (failback of a new PV)
    vb = B.create_volume("topo-b", 64 << 20)
    assert _satisfies(node_a, [dict(t.segments) for t in vb.accessible_topology])
