"""A site of three storage nodes: the controller (no pool) places volumes and sends every
pool operation to the node's queue drsvc.<site>.<node> as a Celery task. Real parts: a
loop-mounted XFS per node, one redis-server, a Celery worker per node, the controller
plugin over its unix socket (drsvc_lab.NodesLab)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import grpc
import pytest

from csi_plugin.gen import csi_pb2, csi_pb2_grpc
from drsvc.config import load
from drsvc_lab import NodesLab, wait_until
from tests.fixtures.csi import capability

MiB = 1 << 20
NODE = "topology.drsvc.io/node"
LABELS = {"n1": {"rack": "r1"}, "n2": {"rack": "r2"}, "n3": {"rack": "r2"}}


@contextlib.contextmanager
def running(lab: NodesLab):
    """The lab up, with .controller and .identity stubs on its controller; torn down after."""
    try:
        lab.build()
        lab.up()
        ch = grpc.insecure_channel(lab.endpoint)
        grpc.channel_ready_future(ch).result(timeout=30)
        lab.controller = csi_pb2_grpc.ControllerStub(ch)
        lab.identity = csi_pb2_grpc.IdentityStub(ch)
        yield lab
        ch.close()
    finally:
        lab.teardown()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    with running(NodesLab(tmp_path_factory.mktemp("nodes"), nodes=("n1", "n2", "n3"), pool_size="1G",
                          labels=LABELS)) as lab:
        yield lab


def create(lab, name, size=64 * MiB, requisite=(), preferred=(), **kw):
    req = csi_pb2.CreateVolumeRequest(
        name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
        volume_capabilities=[capability("ext4")], **kw)
    for term in requisite:
        req.accessibility_requirements.requisite.add(segments=term)
    for term in preferred:
        req.accessibility_requirements.preferred.add(segments=term)
    return lab.controller.CreateVolume(req, timeout=60).volume


def node_of(vol) -> str:
    return vol.accessible_topology[0].segments[NODE]


def images(lab, node) -> set[str]:
    d = lab.pool(node) / "images"
    return {p.name.removesuffix(".img") for p in d.glob("*.img")} if d.exists() else set()


def test_controller_advertises_only_what_it_serves(nodes):
    caps = nodes.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities
    services = {c.service.type for c in caps if c.HasField("service")}
    S = csi_pb2.PluginCapability.Service
    assert services == {S.CONTROLLER_SERVICE, S.VOLUME_ACCESSIBILITY_CONSTRAINTS, S.GROUP_CONTROLLER_SERVICE}
    assert nodes.identity.Probe(csi_pb2.ProbeRequest()).ready.value
    # no Node service here: the node plugins run where the pools are
    ch = grpc.insecure_channel(nodes.endpoint)
    with pytest.raises(grpc.RpcError) as e:
        csi_pb2_grpc.NodeStub(ch).NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    ch.close()


def test_the_runbook_cli_at_the_controller_says_where_the_admin_service_is(nodes):
    """`drsvc status` (or `promote --all`) given the controller's endpoint: the Admin service
    runs on each storage node's plugin (csi_plugin.server._node_server), and the CLI says so
    instead of gRPC's "Method not found!"."""
    from drsvc_cli.client import DrClient, RpcFailed
    with DrClient(nodes.endpoint) as c, pytest.raises(RpcFailed) as e:
        c.statuses()
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "multi-node site's controller" in e.value.message and "--endpoint" in e.value.message, e.value.message


def test_preferred_then_requisite_topology(nodes):
    # preferred names a node: it is chosen
    v = create(nodes, "pref-n3", preferred=[{NODE: "n3"}])
    assert node_of(v) == "n3" and v.volume_id.startswith("n3.")
    assert v.volume_id in images(nodes, "n3")
    # requisite rack r2 (n2, n3), preferred n1 (outside it): placed inside the requisite set
    v = create(nodes, "req-r2", requisite=[{"rack": "r2"}], preferred=[{NODE: "n1"}])
    assert node_of(v) in ("n2", "n3")
    assert dict(v.accessible_topology[0].segments)["rack"] == "r2"
    # a requisite no node offers: RESOURCE_EXHAUSTED, nothing created anywhere
    before = {n: images(nodes, n) for n in nodes.nodes}
    with pytest.raises(grpc.RpcError) as e:
        create(nodes, "nowhere", requisite=[{"rack": "r9"}])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert {n: images(nodes, n) for n in nodes.nodes} == before


def test_without_requirements_places_by_free_capacity(nodes):
    """Fill n1 and n2 with preallocated volumes: a volume with no topology goes to the node
    with the most free space, n3 (placement asks every node's GetCapacity)."""
    big = []
    for n in ("n1", "n2"):
        big.append(create(nodes, f"fill-{n}", size=600 * MiB, preferred=[{NODE: n}],
                          parameters={"preallocate": "true"}))
    assert [node_of(v) for v in big] == ["n1", "n2"]
    placed = [node_of(create(nodes, f"free-{i}", size=16 * MiB)) for i in range(3)]
    assert placed == ["n3"] * 3
    for v in big:
        nodes.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id), timeout=60)


def test_retry_lands_on_the_first_attempts_node(nodes):
    """CreateVolume is idempotent across nodes: the name is claimed for its node, so a retry
    whose placement would now differ (another preferred node) returns the same volume."""
    a = create(nodes, "claimed", preferred=[{NODE: "n1"}])
    b = create(nodes, "claimed", preferred=[{NODE: "n2"}])
    assert a.volume_id == b.volume_id and node_of(b) == "n1"
    assert sum(a.volume_id in images(nodes, n) for n in nodes.nodes) == 1


def test_calls_route_to_the_node_that_holds_the_volume(nodes):
    v = create(nodes, "routed", preferred=[{NODE: "n2"}])
    got = nodes.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=v.volume_id))
    assert got.volume.volume_id == v.volume_id and node_of(got.volume) == "n2"
    size = nodes.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=128 * MiB))).capacity_bytes
    assert size == 128 * MiB
    assert (nodes.pool("n2") / "images" / f"{v.volume_id}.img").stat().st_size == 128 * MiB
    snap = nodes.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        name="routed-snap", source_volume_id=v.volume_id)).snapshot
    assert snap.snapshot_id.startswith("n2.") and snap.ready_to_use
    clone = create(nodes, "routed-clone", volume_content_source=csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)))
    assert node_of(clone) == "n2"          # a clone is a reflink on its source's node
    listed = nodes.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(source_volume_id=v.volume_id))
    assert [e.snapshot.snapshot_id for e in listed.entries] == [snap.snapshot_id]
    for call, req in ((nodes.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(volume_id=clone.volume_id)),
                      (nodes.controller.DeleteSnapshot, csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id)),
                      (nodes.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id))):
        call(req, timeout=60)
        call(req, timeout=60)              # repeat-safe
    assert v.volume_id not in images(nodes, "n2")
    with pytest.raises(grpc.RpcError) as e:
        nodes.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=v.volume_id))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # an id that names no node of this site: NOT_FOUND, and a delete of it is a no-op
    with pytest.raises(grpc.RpcError) as e:
        nodes.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id="n9.vol-0"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    nodes.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id="n9.vol-0"))


def test_list_pages_across_nodes(nodes):
    made = {create(nodes, f"page-{i}", size=8 * MiB, preferred=[{NODE: f"n{1 + i % 3}"}]).volume_id
            for i in range(7)}
    seen, token, pages = [], "", 0
    while True:
        r = nodes.controller.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2, starting_token=token))
        assert len(r.entries) <= 2
        seen += [e.volume.volume_id for e in r.entries]
        pages += 1
        token = r.next_token
        if not token:
            break
    assert made <= set(seen) and len(seen) == len(set(seen))
    assert pages >= 4
    with pytest.raises(grpc.RpcError) as e:
        nodes.controller.ListVolumes(csi_pb2.ListVolumesRequest(starting_token="bogus"))
    assert e.value.code() == grpc.StatusCode.ABORTED
    total = nodes.controller.GetCapacity(csi_pb2.GetCapacityRequest()).available_capacity
    r2 = nodes.controller.GetCapacity(csi_pb2.GetCapacityRequest(
        accessible_topology=csi_pb2.Topology(segments={"rack": "r2"}))).available_capacity
    assert 0 < r2 < total


def test_a_dead_nodes_worker_delays_only_its_own_volumes(nodes):
    """SIGKILL n1's workers: volumes still land on n2 and n3 (placement leaves out a node
    that does not answer), a call on n1's volume is UNAVAILABLE (retry), and once n1's
    workers are back, its task (left in its queue, acks_late) has run and the call succeeds."""
    v1 = create(nodes, "dead-n1", preferred=[{NODE: "n1"}])
    run = nodes.run
    for c in ("api@n1", "worker@n1"):          # the node's workers die with it
        os.killpg(run.pid(c), signal.SIGKILL)
    try:
        t0 = time.monotonic()
        v = create(nodes, "while-n1-dead", preferred=[{NODE: "n1"}])
        assert node_of(v) in ("n2", "n3")
        assert time.monotonic() - t0 < 30
        with pytest.raises(grpc.RpcError) as e:
            nodes.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
                volume_id=v1.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=96 * MiB)),
                timeout=120)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    finally:
        run.start("api@n1")
        run.start("worker@n1")
    wait_until(lambda: (nodes.pool("n1") / "images" / f"{v1.volume_id}.img").stat().st_size == 96 * MiB, 60,
               "n1's queued expand to run after its worker came back", interval=0.2)
    got = nodes.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=v1.volume_id),
                                               timeout=60)
    assert got.volume.capacity_bytes == 96 * MiB


def test_config_names_each_nodes_queue(nodes):
    cfg = load(nodes.config_path)
    assert cfg.multinode and cfg.pool is None
    assert [cfg.node_queue(n) for n in sorted(cfg.nodes)] == ["drsvc.a.n1", "drsvc.a.n2", "drsvc.a.n3"]
    n2 = load(nodes.config_path, node="n2")
    assert n2.pool == nodes.pool("n2")
    assert (n2.queue, n2.control_queue, n2.api_queue("n2")) == ("drsvc.a.n2", "drsvc.a.n2.control", "drsvc.a.n2.api")


def test_group_snapshot_across_nodes_is_cut_at_one_instant(nodes, tmp_path):
    """CreateVolumeGroupSnapshot of volumes on n1, n2 and n3: each node cuts its part as a
    task; every node freezes its members (n1's is staged and mounted by n1's node plugin,
    so it is FIFREEZEd) and meets the others at a barrier before any clones. The parts'
    times show it: the last freeze precedes the first clone. Get merges the parts; Delete
    removes them on every node. A node that does not answer fails the cut and leaves no
    part behind."""
    import hashlib
    import subprocess
    import sys
    sock = tmp_path / "n1.sock"
    plugin = subprocess.Popen([sys.executable, "-m", "csi_plugin", "--config", str(nodes.config_path), "--node", "n1",
                               "--endpoint", f"unix://{sock}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ch = grpc.insecure_channel(f"unix://{sock}")
    try:
        grpc.channel_ready_future(ch).result(timeout=30)
        node1 = csi_pb2_grpc.NodeStub(ch)
        vols = {n: create(nodes, f"gs-{n}", requisite=[{NODE: n}]).volume_id for n in ("n1", "n2", "n3")}
        stage = tmp_path / "stage-n1"
        node1.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=vols["n1"], staging_target_path=str(stage), volume_capability=capability("ext4")), timeout=60)
        (stage / "data").write_bytes(os.urandom(1 << 20))
        for n in ("n2", "n3"):
            with open(nodes.pool(n) / "images" / f"{vols[n]}.img", "r+b") as f:
                f.write(os.urandom(1 << 20))
        sha = {n: hashlib.sha256((nodes.pool(n) / "images" / f"{vols[n]}.img").read_bytes()).hexdigest()
               for n in ("n2", "n3")}
        gc = csi_pb2_grpc.GroupControllerStub(grpc.insecure_channel(nodes.endpoint))
        req = csi_pb2.CreateVolumeGroupSnapshotRequest(name="across", source_volume_ids=list(vols.values()))
        gs = gc.CreateVolumeGroupSnapshot(req, timeout=60).group_snapshot
        assert gs.ready_to_use and len(gs.snapshots) == 3
        by_source = {s.source_volume_id: s.snapshot_id for s in gs.snapshots}
        for n, v in vols.items():
            assert by_source[v].startswith(f"{n}.")
        parts = {n: json.loads((nodes.pool(n) / "group_snapshots" / f"{gs.group_snapshot_id}.json").read_text())
                 for n in vols}
        assert max(p["frozen_at"] for p in parts.values()) <= min(p["cloned_at"] for p in parts.values())
        for n in ("n2", "n3"):
            snap_img = nodes.pool(n) / "snapshots" / f"{by_source[vols[n]]}.img"
            assert hashlib.sha256(snap_img.read_bytes()).hexdigest() == sha[n]
        # a retry by name answers the same group snapshot
        again = gc.CreateVolumeGroupSnapshot(req, timeout=60).group_snapshot
        assert again.group_snapshot_id == gs.group_snapshot_id
        got = gc.GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest(
            group_snapshot_id=gs.group_snapshot_id, snapshot_ids=list(by_source.values())), timeout=60)
        assert sorted(s.snapshot_id for s in got.group_snapshot.snapshots) == sorted(by_source.values())
        with pytest.raises(grpc.RpcError) as e:
            gc.GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest(
                group_snapshot_id=gs.group_snapshot_id, snapshot_ids=[by_source[vols["n1"]]]), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        delete = csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=gs.group_snapshot_id)
        gc.DeleteVolumeGroupSnapshot(delete, timeout=60)
        gc.DeleteVolumeGroupSnapshot(delete, timeout=60)
        for n in vols:
            assert not list((nodes.pool(n) / "group_snapshots").glob("*.json"))
            assert not list((nodes.pool(n) / "snapshots").glob(f"{n}.snap-*"))

        # n3 does not answer: the cut fails, and no part stays on n1 or n2 (frozen no longer)
        run = nodes.run
        os.killpg(run.pid("api@n3"), signal.SIGKILL)
        try:
            with pytest.raises(grpc.RpcError) as e:
                gc.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
                    name="dead", source_volume_ids=list(vols.values())), timeout=120)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
        finally:
            run.start("api@n3")
        for n in ("n1", "n2"):
            assert not list((nodes.pool(n) / "group_snapshots").glob("*.json"))
        (stage / "probe").write_text("writable: thawed")
        node1.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vols["n1"], staging_target_path=str(stage)), timeout=60)
    finally:
        ch.close()
        plugin.terminate()
        plugin.wait(timeout=20)


def test_a_retried_delete_whose_first_answer_was_lost_frees_the_name(nodes):
    """The node deleted the volume but the controller never heard (a lost answer): the
    retried DeleteVolume finds nothing on the node, and must still drop the name's claim,
    or the name would stay pinned to n1 and a later CreateVolume of it needing n2 would
    fail for good. The claim is remembered per id in Redis at create time."""
    from workers.app import make_app
    from workers.client import NodeDispatcher
    v = create(nodes, "lost-answer", requisite=[{NODE: "n1"}])
    calls = NodeDispatcher(make_app(nodes.cfg))
    calls.call("n1", "delete_volume", {"volume_id": v.volume_id}, wait=30)    # the first attempt, unheard
    nodes.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id), timeout=60)
    again = create(nodes, "lost-answer", requisite=[{NODE: "n2"}])
    assert node_of(again) == "n2"


def test_fqdn_node_names_route_to_their_own_node(tmp_path):
    """Kubernetes node names are often FQDNs (a kubelet registers the host's name). Nodes
    "w1.dc1.example.com" and "w1" in one site: each id goes to the node that made it, the
    longer name never loses its ids to the shorter one."""
    fq = "w1.dc1.example.com"
    with running(NodesLab(tmp_path / "fqdn", nodes=(fq, "w1"), pool_size="512M")) as lab:
        for node in (fq, "w1"):
            v = create(lab, f"on-{node}", preferred=[{NODE: node}])
            assert node_of(v) == node and v.volume_id.startswith(f"{node}.vol-")
            assert v.volume_id in images(lab, node)
            snap = lab.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
                name=f"snap-{node}", source_volume_id=v.volume_id), timeout=60).snapshot
            assert snap.snapshot_id.startswith(f"{node}.snap-") and snap.ready_to_use
            got = lab.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=v.volume_id))
            assert node_of(got.volume) == node
            lab.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id), timeout=60)
            lab.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id), timeout=60)
            assert v.volume_id not in images(lab, node)
