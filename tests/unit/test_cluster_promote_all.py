"""ClusterReplication.promote_all (the multi-node controller's side of Site.PromoteAll) on
fake node calls: every node lists its secondaries, a unit listed by several nodes is a group
spanning them and is promoted by itself after the batches, each node's batch carries only its
own units, a node that does not answer fails its units (not the others'), and each result
keeps the row its node listed. The node side runs for real in tests/multinode/test_site_promote.py."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from csi_plugin.errors import code_for_name
from drsvc.cluster import ClusterReplication
from drsvc.errors import NodeUnreachable

pytestmark = pytest.mark.fast

LISTED = {
    "n1": [{"unit_id": "n1.v1", "kind": "volume", "generation": 4}, {"unit_id": "n1.g", "kind": "group", "generation": 7}],
    "n2": [{"unit_id": "n2.v2", "kind": "volume", "generation": 5}, {"unit_id": "n1.g", "kind": "group", "generation": 7}],
    "n3": [{"unit_id": "n3.v3", "kind": "volume", "generation": 6}],
}


class Calls:
    def __init__(self, down=()):
        self.down, self.batches = set(down), {}

    def call_each(self, calls: dict, op: str, *, wait: float) -> dict:
        assert op in ("promote_all", "demote_all")
        self.op = op
        out = {}
        for n, kw in calls.items():
            if kw.get("dry_run"):
                out[n] = LISTED[n]
            elif n in self.down:
                out[n] = NodeUnreachable(node=n, reason="no answer")
            else:
                self.batches[n] = kw
                out[n] = [{"unit_id": u, "result": "promoted", "epoch": 2, "seconds": 0.01} for u in kw["units"]] \
                    if op == "promote_all" else \
                    [{"unit_id": u, "result": "demoted", "final_sync": False, "resync": "requested", "seconds": 0.01}
                     for u in kw["units"]]
        return out


class Replication(ClusterReplication):
    def __init__(self, calls):
        router = SimpleNamespace(nodes=sorted(LISTED), calls=calls, wait=5.0,
                                 call_all=lambda c, op, wait=None: calls.call_each(c, op, wait=wait))
        super().__init__(router)
        self.spanning = []

    def promote(self, kind, ident, force, params=None):      # a spanning group's own promote
        self.spanning.append((kind, ident, force))

    def demote(self, kind, ident, force):                    # ... and its own demote and resync
        self.spanning.append(("demote", kind, ident))

    def resync(self, kind, ident, force):
        self.spanning.append(("resync", kind, ident, force))
        return False


def test_each_node_promotes_its_own_units_and_a_spanning_group_goes_alone():
    calls = Calls()
    r = Replication(calls)
    rows = r.promote_all(True)
    assert {n: kw["units"] for n, kw in calls.batches.items()} == {"n1": ["n1.v1"], "n2": ["n2.v2"], "n3": ["n3.v3"]}
    assert all(kw["force"] for kw in calls.batches.values())
    assert r.spanning == [("group", "n1.g", True)]
    by = {x["unit_id"]: x for x in rows}
    assert sorted(by) == ["n1.g", "n1.v1", "n2.v2", "n3.v3"] and len(rows) == 4
    assert by["n2.v2"] == {"unit_id": "n2.v2", "kind": "volume", "generation": 5, "result": "promoted",
                           "epoch": 2, "seconds": 0.01}
    assert by["n1.g"]["result"] == "promoted" and by["n1.g"]["kind"] == "group"


def test_a_dry_run_lists_each_unit_once_and_sends_no_batch():
    calls = Calls()
    r = Replication(calls)
    rows = r.promote_all(True, dry_run=True)
    assert [x["unit_id"] for x in rows] == ["n1.g", "n1.v1", "n2.v2", "n3.v3"]
    assert {x["result"] for x in rows} == {"would promote"} and not calls.batches and not r.spanning


def test_a_node_that_does_not_answer_fails_only_its_units():
    rows = {x["unit_id"]: x for x in Replication(Calls(down={"n2"})).promote_all(True)}
    assert rows["n2.v2"]["result"] == "failed" and rows["n2.v2"]["error"] == "NodeUnreachable"
    assert rows["n2.v2"]["generation"] == 5                   # the row its node listed
    assert code_for_name(rows["n2.v2"]["error"]) == grpc.StatusCode.UNAVAILABLE
    assert {rows[u]["result"] for u in ("n1.v1", "n3.v3", "n1.g")} == {"promoted"}


def test_a_site_demote_sends_each_node_its_own_units_and_resyncs_a_spanning_group_after_its_demote():
    """ClusterReplication.demote_all, the controller's side of Site.DemoteAll: the same cut
    as promote_all's, with the resync asked of every batch and of the spanning group."""
    calls = Calls()
    r = Replication(calls)
    rows = {x["unit_id"]: x for x in r.demote_all(resync=True)}
    assert calls.op == "demote_all"
    assert {n: kw["units"] for n, kw in calls.batches.items()} == {"n1": ["n1.v1"], "n2": ["n2.v2"], "n3": ["n3.v3"]}
    assert all(kw["resync"] for kw in calls.batches.values())
    assert r.spanning == [("demote", "group", "n1.g"), ("resync", "group", "n1.g", True)]
    assert rows["n1.g"]["result"] == "demoted" and rows["n1.g"]["resync"] == "requested"
    assert rows["n3.v3"] == {"unit_id": "n3.v3", "kind": "volume", "generation": 6, "result": "demoted",
                             "final_sync": False, "resync": "requested", "seconds": 0.01}
    dry = Replication(Calls()).demote_all(dry_run=True)
    assert [x["unit_id"] for x in dry] == ["n1.g", "n1.v1", "n2.v2", "n3.v3"]
    assert {x["result"] for x in dry} == {"would demote"}


def test_an_unknown_error_name_is_internal():
    assert code_for_name("NoSuchError") == grpc.StatusCode.INTERNAL
    assert code_for_name("") == grpc.StatusCode.INTERNAL
