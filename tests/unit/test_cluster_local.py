"""The controller contract, run the same way against both implementations, on pools in a
temp dir (no root, no lab): PoolController over one pool, and ClusterController over two
storage nodes whose NodeOps run in this process. Between the controller and the nodes
every argument and answer goes through JSON and every error through the task's error dict
(drsvc.dispatch), as workers.client.NodeDispatcher carries them over Celery; only the
transport (NodeCalls) and the barrier are in-process. csi-driver-host-path tests its
``State`` interface the same way, with only a temp dir (pkg/state/state_test.go)."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from drsvc import config
from drsvc.cluster import ClusterController, NodeOps
from drsvc.controller import PoolController
from drsvc.dispatch import error_to_dict, raise_from_dict
from drsvc.errors import (DrsvcError, GroupSnapshotNotFound, NodeUnreachable, NotGroupConsistent, SnapshotExists,
                          SnapshotNotFound, VolumeNotFound)
from drsvc.model import Capability, ContentSource
from drsvc.site import Site
from drsvc.volumes import TOPOLOGY_NODE

pytestmark = pytest.mark.fast
CAPS = [Capability("mount", "SINGLE_NODE_WRITER", "xfs")]
MiB = 1 << 20


class LocalNodes:
    """drsvc.cluster.NodeCalls in one process (see the module's docstring); names claimed in
    a dict; nodes in *down* do not answer."""

    def __init__(self, ops: dict[str, NodeOps]):
        self.ops = ops
        self.down: set[str] = set()
        self.names: dict[str, str] = {}
        self.ids: dict[str, str] = {}
        self.sent: list[tuple[str, str]] = []

    def call(self, node: str, op: str, kwargs: dict, *, wait: float):
        self.sent.append((node, op))
        if node in self.down:
            raise NodeUnreachable(node=node, site="a", wait=wait, reason="down in this test")
        try:
            answer = {"ok": True, "value": self.ops[node].run(op, json.loads(json.dumps(kwargs)))}
        except DrsvcError as e:
            answer = error_to_dict(e)
        return raise_from_dict(json.loads(json.dumps(answer))).get("value")

    def call_each(self, calls: dict[str, dict], op: str, *, wait: float) -> dict:
        with ThreadPoolExecutor(max(1, len(calls))) as ex:
            futures = {n: ex.submit(self.call, n, op, kwargs, wait=wait) for n, kwargs in calls.items()}
        out = {}
        for n, f in futures.items():
            try:
                out[n] = f.result()
            except DrsvcError as e:
                out[n] = e
        return out

    def holder(self, key):
        return self.names.get(key)

    def claim(self, key, node):
        return self.names.setdefault(key, node)

    def release(self, key, node):
        if self.names.get(key) == node:
            del self.names[key]

    def bind(self, object_id, key):
        self.ids[object_id] = key

    def unbind(self, object_id):
        return self.ids.pop(object_id, None)


class Barriers:
    """(name, parties, timeout) -> a Barrier shared by the parts of one group snapshot."""

    def __init__(self):
        self.lock = threading.Lock()
        self.barriers: dict[str, threading.Barrier] = {}

    def __call__(self, name: str, parties: int, timeout: float):
        with self.lock:
            b = self.barriers.setdefault(name, threading.Barrier(parties, timeout=timeout))

        class Meeting:
            def wait(self):
                try:
                    b.wait()
                except threading.BrokenBarrierError:
                    raise NotGroupConsistent(reason="not every node froze in time") from None
        return Meeting()


@pytest.fixture
def pool_ctl(tmp_path):
    return PoolController(Site.open(tmp_path / "pool", node_id="n1", site_id="a"))


@pytest.fixture
def cluster(tmp_path):
    doc = {"site": "a", "redis_url": "redis://unused",
           "nodes": {n: {"pool": str(tmp_path / n)} for n in ("n1", "n2")}}
    barriers = Barriers()
    ops = {n: NodeOps(PoolController(Site.from_config(config.parse(doc, node=n))), barrier=barriers)
           for n in ("n1", "n2")}
    nodes = LocalNodes(ops)
    return ClusterController(config.parse(doc), nodes, wait=5.0, probe_wait=1.0), nodes


def _on(node: str | None) -> dict:
    """CreateVolume arguments that place a volume on *node* of the cluster (none: anywhere)."""
    return {"requisite": [{TOPOLOGY_NODE: node}]} if node else {}


def _contract_scenario(ctl, nodes: tuple):
    """Every contract operation once, with the answers the CSI spec asks of a retry and of
    an object already gone; *nodes*: where to put two volumes (None: the one pool)."""
    assert ctl.site_name == "a"
    ctl.probe()
    v1 = ctl.create_volume("v1", required_bytes=MiB, capabilities=CAPS, **_on(nodes[0]))
    assert ctl.create_volume("v1", required_bytes=MiB, capabilities=CAPS).volume_id == v1.volume_id
    v2 = ctl.create_volume("v2", required_bytes=MiB, capabilities=CAPS, **_on(nodes[1]))
    assert ctl.get_volume(v1.volume_id).volume.name == "v1"
    assert ctl.validate(v1.volume_id, CAPS, {}) == ""
    assert ctl.capacity(None, CAPS, {}).available > 0
    assert ctl.expand_volume(v1.volume_id, 2 * MiB, 0) >= 2 * MiB
    ctl.modify_volume(v1.volume_id, {})

    s1 = ctl.create_snapshot("s1", v1.volume_id, {})
    assert ctl.create_snapshot("s1", v1.volume_id, {}).snapshot_id == s1.snapshot_id
    assert ctl.get_snapshot(s1.snapshot_id).source_volume_id == v1.volume_id
    assert [s.snapshot_id for s in ctl.list_snapshots(source_volume_id=v1.volume_id).items] == [s1.snapshot_id]
    clone = ctl.create_volume("c1", capabilities=CAPS, source=ContentSource("snapshot", s1.snapshot_id))
    assert clone.source == {"kind": "snapshot", "source_id": s1.snapshot_id}

    seen, token = [], ""
    while True:                      # one entry a page, across the nodes
        page = ctl.list_volumes(1, token)
        seen += [st.volume.volume_id for st in page.items]
        token = page.next_token
        if not token:
            break
    assert sorted(seen) == sorted([v1.volume_id, v2.volume_id, clone.volume_id])

    g = ctl.create_group("g1", {}, [v1.volume_id])
    assert [v.volume_id for v in ctl.get_group(g.group.group_id).volumes] == [v1.volume_id]
    assert [v.group.group_id for v in ctl.list_groups().items] == [g.group.group_id]
    ctl.modify_group(g.group.group_id, [], {})
    assert ctl.get_group(g.group.group_id).volumes == []
    ctl.delete_group(g.group.group_id)
    ctl.delete_group(g.group.group_id)

    gs, members = ctl.create_group_snapshot("gs1", [v1.volume_id, v2.volume_id], {})
    assert gs.state == "ready" and sorted(m.source_volume_id for m in members) == sorted([v1.volume_id, v2.volume_id])
    assert ctl.create_group_snapshot("gs1", [v2.volume_id, v1.volume_id], {})[0].group_snapshot_id == gs.group_snapshot_id
    assert ctl.get_group_snapshot(gs.group_snapshot_id, gs.snapshot_ids)[0].snapshot_ids == gs.snapshot_ids
    ctl.delete_group_snapshot(gs.group_snapshot_id, gs.snapshot_ids)
    ctl.delete_group_snapshot(gs.group_snapshot_id)
    with pytest.raises(GroupSnapshotNotFound):
        ctl.get_group_snapshot(gs.group_snapshot_id)

    for _ in range(2):
        ctl.delete_snapshot(s1.snapshot_id)
    with pytest.raises(SnapshotNotFound):
        ctl.get_snapshot(s1.snapshot_id)
    for vol in (v1, v2, clone):
        for _ in range(2):
            ctl.delete_volume(vol.volume_id)
        with pytest.raises(VolumeNotFound):
            ctl.get_volume(vol.volume_id)
    assert ctl.list_volumes().items == []
    return gs


def test_the_pool_controller_answers_the_contract(pool_ctl):
    _contract_scenario(pool_ctl, (None, None))


def test_the_cluster_controller_answers_the_contract_across_two_nodes(cluster):
    ctl, nodes = cluster
    gs = _contract_scenario(ctl, ("n1", "n2"))
    assert gs.nodes == ["n1", "n2"]              # cut in two parts, one per node
    assert ("n2", "group_snapshot_part") in nodes.sent
    assert nodes.names == {} and nodes.ids == {}     # every name let go with its object


def test_a_group_spanning_nodes_is_kept_in_parts_and_merged(cluster):
    ctl, nodes = cluster
    v1 = ctl.create_volume("v1", required_bytes=MiB, capabilities=CAPS, **_on("n1"))
    v2 = ctl.create_volume("v2", required_bytes=MiB, capabilities=CAPS, **_on("n2"))
    g = ctl.create_group("g", {"k": "v"}, [v1.volume_id, v2.volume_id])
    gid = g.group.group_id
    assert gid.startswith("n1.") and sorted(g.group.nodes) == ["n1", "n2"]
    assert [v.volume_id for v in ctl.get_group(gid).volumes] == [v1.volume_id, v2.volume_id]
    assert [v.group.group_id for v in ctl.list_groups().items] == [gid]      # the home's part only
    assert ctl.modify_group(gid, [v1.volume_id]).group.volume_ids == [v1.volume_id]
    assert nodes.ops["n2"].ctl.site.groups.find(gid) is None                  # n2's part dropped
    ctl.delete_group(gid)                            # with its members: v1; v2 left it
    assert ctl.list_groups().items == []
    assert [st.volume.volume_id for st in ctl.list_volumes().items] == [v2.volume_id]


def test_a_name_stays_with_its_node(cluster):
    """A retried create goes where the first went, without asking placement again; a
    snapshot name taken on one node is ALREADY_EXISTS on another."""
    ctl, nodes = cluster
    v1 = ctl.create_volume("v1", required_bytes=MiB, capabilities=CAPS, **_on("n1"))
    v2 = ctl.create_volume("v2", required_bytes=MiB, capabilities=CAPS, **_on("n2"))
    before = len(nodes.sent)
    assert ctl.create_volume("v1", required_bytes=MiB, capabilities=CAPS, **_on("n1")).volume_id == v1.volume_id
    assert nodes.sent[before:] == [("n1", "create_volume")]
    ctl.create_snapshot("s", v1.volume_id)
    with pytest.raises(SnapshotExists):
        ctl.create_snapshot("s", v2.volume_id)


def test_a_node_that_does_not_answer_is_left_out_of_placement(cluster):
    ctl, nodes = cluster
    nodes.down.add("n2")
    ctl.probe()                                      # one node answering is enough
    vols = [ctl.create_volume(f"v{i}", required_bytes=MiB, capabilities=CAPS) for i in range(3)]
    assert {ctl.node_of(v.volume_id) for v in vols} == {"n1"}
    assert sum(1 for n, op in nodes.sent if (n, op) == ("n2", "capacity")) == 1     # then suspect
    nodes.down.add("n1")
    with pytest.raises(NodeUnreachable):
        ctl.probe()
