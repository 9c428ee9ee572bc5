"""What csi-sanity (and the CSI spec's codes) found against a multi-node site: the site's
controller plus n1's plugin, real parts (tests/multinode/conftest.py site_n1)."""
from __future__ import annotations

import grpc
import pytest

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import capability

MiB = 1 << 20
S = csi_pb2.PluginCapability.Service


def services(identity) -> set:
    caps = identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest(), timeout=10).capabilities
    return {c.service.type for c in caps if c.HasField("service")}


def images(lab) -> dict[str, set[str]]:
    out = {}
    for n in lab.nodes:
        d = lab.pool(n) / "images"
        out[n] = {p.name for p in d.glob("*.img")} if d.exists() else set()
    return out


def test_node_plugin_advertises_only_what_the_site_serves(site_n1):
    """csi-sanity reads the plugin's services from the node's Identity and sends the
    controller calls to the controller's endpoint. n1's plugin advertised its one-node
    services (SNAPSHOT_METADATA_SERVICE too, and GROUP_CONTROLLER_SERVICE before the
    controller served it), which the site's controller did not serve: UNIMPLEMENTED
    failures. A node now speaks for its site, and the controller serves what both say."""
    assert services(site_n1.n1.identity) == services(site_n1.identity) == {
        S.CONTROLLER_SERVICE, S.VOLUME_ACCESSIBILITY_CONSTRAINTS, S.GROUP_CONTROLLER_SERVICE}
    caps = site_n1.group_controller.GroupControllerGetCapabilities(
        csi_pb2.GroupControllerGetCapabilitiesRequest(), timeout=10).capabilities
    assert caps
    assert site_n1.n1.probe()


def test_a_volume_in_the_nodes_topology_lands_there_and_stages_there(site_n1, tmp_path):
    """csi-sanity's flow: NodeGetInfo's topology as the requisite, CreateVolume on the
    controller, then stage, publish, stats and their undoing on n1's plugin."""
    info = site_n1.n1.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
    assert info.node_id == "n1"
    req = csi_pb2.CreateVolumeRequest(name="on-n1", capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MiB),
                                      volume_capabilities=[capability("ext4")])
    req.accessibility_requirements.requisite.add().CopyFrom(info.accessible_topology)
    vol = site_n1.controller.CreateVolume(req, timeout=60).volume
    assert vol.volume_id.startswith("n1.")
    staging, target = tmp_path / "staging", tmp_path / "target"
    staging.mkdir()
    n1 = site_n1.n1
    n1.stage(vol.volume_id, staging)
    n1.publish(vol.volume_id, staging, target)
    (target / "f").write_bytes(b"x" * 4096)
    stats = n1.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=str(target)), timeout=30)
    assert stats.usage and not stats.volume_condition.abnormal
    got = site_n1.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id),
                                                 timeout=60)
    assert list(got.status.published_node_ids) == ["n1"]
    n1.unpublish(vol.volume_id, target)
    n1.unstage(vol.volume_id, staging)
    for _ in range(2):                  # repeat-safe
        site_n1.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id), timeout=60)
    assert f"{vol.volume_id}.img" not in images(site_n1)["n1"]


def test_create_volume_answers_with_the_one_node_codes(site_n1):
    """Placement ran before the request was checked, so a multi-node site answered
    RESOURCE_EXHAUSTED ("no node has room") where a one-node site's plugin answers
    INVALID_ARGUMENT (a capability no node supports) or OUT_OF_RANGE (larger than any
    pool: no placement will ever fit). Nothing is created, and the name stays free."""
    before = images(site_n1)
    mn = capability("ext4", csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER)
    cases = [
        ("multi-writer", {"volume_capabilities": [mn]}, grpc.StatusCode.INVALID_ARGUMENT),
        ("bad-fs", {"volume_capabilities": [capability("zfs")]}, grpc.StatusCode.INVALID_ARGUMENT),
        ("huge", {"volume_capabilities": [capability("ext4")],
                  "capacity_range": csi_pb2.CapacityRange(required_bytes=1 << 50)}, grpc.StatusCode.OUT_OF_RANGE),
        ("huge-on-n1", {"volume_capabilities": [capability("ext4")],
                        "capacity_range": csi_pb2.CapacityRange(required_bytes=1 << 50),
                        "accessibility_requirements": csi_pb2.TopologyRequirement(requisite=[
                            csi_pb2.Topology(segments={"topology.drsvc.io/node": "n1"})])},
         grpc.StatusCode.OUT_OF_RANGE),
    ]
    for name, kw, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            site_n1.controller.CreateVolume(csi_pb2.CreateVolumeRequest(name=f"bad-{name}", **kw), timeout=60)
        assert e.value.code() == code, (name, e.value.details())
    assert images(site_n1) == before
    # the names were not claimed: a valid request under one of them is placed and made
    vol = site_n1.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="bad-huge", volume_capabilities=[capability("ext4")],
        capacity_range=csi_pb2.CapacityRange(required_bytes=16 * MiB)), timeout=60).volume
    site_n1.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id), timeout=60)


def test_a_nodes_plugin_does_not_answer_controller_calls(site_n1):
    """A node's plugin over its own pool would bypass the site controller's name claims
    and placement: Controller calls there are UNIMPLEMENTED (the CO sends them to the
    controller's endpoint)."""
    with pytest.raises(grpc.RpcError) as e:
        site_n1.n1.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
            name="bypass", volume_capabilities=[capability("ext4")]), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
