"""The multi-node site config: a node's view, its queues, its peer node, its topology pair."""
from __future__ import annotations

import pytest

from drsvc import config
from drsvc.errors import ConfigInvalid, NodeNotFound
from drsvc.volumes import TOPOLOGY_NODE, node_topology

A = {"site": "a", "redis_url": "redis://x",
     "nodes": {"n1": {"pool": "/p1"}, "n2": {"pool": "/p2", "peer_node": "m2", "labels": {"rack": "r2"}}},
     "peers": {"b": {"host": "h", "known_hosts": "/kh", "key": "/k",
                     "nodes": {"n1": {"host": "10.0.1.1", "port": 2201}, "m2": {"host": "10.0.1.2"}}}}}
B = {"site": "b", "redis_url": "redis://x",
     "nodes": {"n1": {"pool": "/q1"}, "m2": {"pool": "/q2", "peer_node": "n2"}},
     "peers": {"a": {"host": "h", "known_hosts": "/kh", "key": "/k"}}}


def test_a_nodes_view_has_its_pool_queues_and_peer_node():
    site = config.parse(A)
    assert site.multinode and site.pool is None and site.queue == "drsvc.a"
    n2 = config.parse(A, node="n2")
    assert (n2.node_id, str(n2.pool), n2.scope) == ("n2", "/p2", "a.n2")
    assert (n2.queue, n2.control_queue, n2.api_queue("n2")) == ("drsvc.a.n2", "drsvc.a.n2.control", "drsvc.a.n2.api")
    assert (n2.peer("b").host, n2.peer("b").port) == ("10.0.1.2", 22)          # n2 pairs with b's m2
    n1 = config.parse(A, node="n1")
    assert (n1.peer("b").host, n1.peer("b").port) == ("10.0.1.1", 2201)


def test_a_one_node_site_is_unchanged():
    one = config.parse({"site": "a", "pool": "/p"})
    assert not one.multinode and (one.queue, one.control_queue, one.scope) == ("drsvc.a", "drsvc.a.control", "a")


def test_pairs_advertise_the_same_node_topology_at_both_sites():
    a, b = config.parse(A), config.parse(B)
    assert a.nodes["n1"].pair == b.nodes["n1"].pair == "n1"
    assert a.nodes["n2"].pair == b.nodes["m2"].pair == "m2-n2"
    assert node_topology("a-b", a.nodes["n2"].pair, {"rack": "r2"})[TOPOLOGY_NODE] == "m2-n2"


@pytest.mark.parametrize("doc, err", [
    ({"site": "a"}, ConfigInvalid),                                              # no pool, no nodes
    ({"site": "a", "nodes": {"control": {"pool": "/p"}}}, ConfigInvalid),        # a queue suffix
    ({"site": "a", "nodes": {"n1": {}}}, ConfigInvalid),                         # no pool
    ({"site": "a", "nodes": {"n1": {"pool": "/p", "labels": {"k": 1}}}}, ConfigInvalid),
])
def test_bad_node_tables_are_refused(doc, err):
    with pytest.raises(err):
        config.parse(doc)


def test_unknown_nodes_are_named():
    with pytest.raises(NodeNotFound, match="n9"):
        config.parse(A, node="n9")
    with pytest.raises(ConfigInvalid, match="lists no node"):
        config.parse({**A, "nodes": {"n3": {"pool": "/p3"}}}, node="n3")       # b has no n3


def test_page_tokens_and_numbers_are_ascii_digits_only():
    """'²'.isdigit() is True in Python, and int('²') raises: a fuzzed ListVolumes token
    answered INTERNAL. Such a token is a bad page token (ABORTED at the edge)."""
    from drsvc.errors import BadPageToken
    from drsvc.paging import paginate
    for token in ("²", "١", "12³"):
        with pytest.raises(BadPageToken):
            paginate([1, 2, 3], 0, token)
    assert paginate([1, 2, 3], 1, "1").items == [2]


def test_fqdn_node_names_are_allowed_and_ids_name_the_longest_node_that_fits():
    """Kubernetes node names are often FQDNs; a node "w1" beside "w1.dc1.example.com" must
    not take the other's ids."""
    from drsvc.cluster import ClusterController
    doc = {"site": "a", "redis_url": "redis://x",
           "nodes": {"w1.dc1.example.com": {"pool": "/p1"}, "w1": {"pool": "/p2"}}}
    site = config.parse(doc)
    fq = config.parse(doc, node="w1.dc1.example.com")
    assert (fq.queue, fq.control_queue, fq.scope) == (
        "drsvc.a.w1.dc1.example.com", "drsvc.a.w1.dc1.example.com.control", "a.w1.dc1.example.com")
    ctl = ClusterController(site, calls=None)
    assert ctl.node_of("w1.dc1.example.com.vol-0123") == "w1.dc1.example.com"
    assert ctl.node_of("w1.vol-0123") == "w1"
    assert ctl.node_of("w1.dc1.vol-0123") == "w1"          # only a listed node: w1's local id "dc1.vol-0123"
    assert ctl.node_of("w2.vol-0123") is None
    assert ctl.node_of("w1") is None


@pytest.mark.parametrize("name", ["n1.api", "n1.control", "api", "n1.", "n1..x", ".n1", "n 1", "n1/x"])
def test_node_names_that_would_take_a_queue_or_a_path_are_refused(name):
    with pytest.raises(ConfigInvalid, match="node name"):
        config.parse({"site": "a", "nodes": {name: {"pool": "/p"}}})
