"""A site failover at a multi-node site: `drsvc promote --all --force` at b's controller
endpoint. The controller serves the Site service (PromoteAll), which the CLI calls once: each
storage node promotes its own units as one batch on its control worker, and a group spanning
nodes is promoted as its own PromoteVolume would be (its parts settled first), so both parts
take over at one generation and one epoch. A dry run lists every unit once and changes
nothing; a second run finds nothing left. Then site a comes back and `drsvc demote --all
--resync` at its controller (DemoteAll) hands every unit home to b's copies. The CLI's other commands still need a node's
endpoint there (the controller serves no Admin service)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from csi_plugin.gen import volumegroup_pb2
from drsvc.replication.common.unit_state import find_state
from drsvc.replication.control.relationship import find_control
from drsvc_lab.nodes import node_components
from tests.dr.helpers import resync_ready, wait_each_ready, wait_for, write_random
from tests.fixtures.sites import image_sha
from tests.multinode.test_dr import INTERVAL, at, gen, on, two_sites


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with two_sites(tmp_path_factory.mktemp("mn-site")) as lab:
        yield lab


def drsvc(lab, *args, site="b"):
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", *args, "--endpoint", lab.endpoint_of(site), "--json"],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_promote_all_at_a_multi_node_controller(lab):
    A = lab.clients["a"]
    vols = {on(A, "st-1", "n1"): "n1", on(A, "st-2", "n2"): "n2", on(A, "st-3", "n2"): "n2"}
    span = {on(A, "st-g1", "n1"): "n1", on(A, "st-g2", "n2"): "n2"}
    gid = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(
        name="st-span", volume_ids=list(span))).volume_group.volume_group_id
    for v, n in {**vols, **span}.items():
        write_random(at(lab, "a", n), v, count=4, seed=len(v))
    for v in vols:
        A.retry("EnableVolumeReplication", volume_id=v, parameters=INTERVAL)
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
    where = {**vols, gid: "n1"}
    for u, n in where.items():
        wait_for(lambda u=u, n=n: gen(lab, "b", n, u) >= 2, 90, what=f"two syncs of {u}")
    run = lab.run_of("a")                                   # site a is lost: its processes and sshd
    for c in reversed(node_components(run.cfg)):
        run.stop(c, sig=signal.SIGKILL)
    for n in lab.nodes:
        lab.stop_sshd("a", n)
    acked = {v: image_sha(at(lab, "b", n), v) for v, n in {**vols, **span}.items()}
    epochs = {u: find_state(lab.pool(n, "b"), u).epoch for u, n in where.items()}

    rc, dry = drsvc(lab, "promote", "--all", "--force", "--dry-run")
    assert rc == 0 and dry["result"]["changed"] is False, dry
    assert sorted(u["unit_id"] for u in dry["result"]["units"]) == sorted(where), dry   # the group once
    assert all(find_state(lab.pool(n, "b"), u).role == "secondary" for u, n in where.items())

    rc, run = drsvc(lab, "promote", "--all", "--force")
    r = run["result"]
    assert rc == 0 and r["failed"] == 0 and r["promoted"] == len(where), run
    assert sorted(x["unit_id"] for x in r["results"]) == sorted(where), run
    for u, n in where.items():
        st = find_state(lab.pool(n, "b"), u)
        assert (st.role, st.epoch) == ("primary", epochs[u] + 1), (u, st.role, st.epoch)
    parts = [find_state(lab.pool(n, "b"), gid) for n in lab.nodes]
    assert {(p.role, p.epoch, p.generation) for p in parts} == {("primary", epochs[gid] + 1, parts[0].generation)}
    for v, n in {**vols, **span}.items():                   # the copies taken over are what b held
        assert image_sha(at(lab, "b", n), v) == acked[v], v

    rc, again = drsvc(lab, "promote", "--all", "--force")
    assert rc == 0 and again["result"]["units"] == 0 and again["result"]["changed"] is False, again

    # site a comes back, its units still primary there: `demote --all --resync` at its
    # controller demotes each node's units in one batch and the spanning group by itself, and
    # resyncs them all; b's next syncs bring every copy at a to b's
    for n in lab.nodes:
        lab.start_sshd("a", n)
    lab.up("a")
    rc, back = drsvc(lab, "demote", "--all", "--resync", site="a")
    r = back["result"]
    assert rc == 0 and r["failed"] == 0 and sorted(x["unit_id"] for x in r["results"]) == sorted(where), back
    assert all(x["result"] == "demoted" and x["resync"] in ("requested", "ready") for x in r["results"]), back

    _wait_home(lab, A, where, gid)
    assert all(find_state(lab.pool(n, "a"), u).role == "secondary" for u, n in where.items())
    for v, n in {**vols, **span}.items():
        assert image_sha(at(lab, "a", n), v) == image_sha(at(lab, "b", n), v), v


def _wait_home(lab, A, where: dict, gid: str) -> None:
    def why(pending):       # a group's every part: one part's sync may hold up the other's
        print(json.dumps({f"{u}@{n}": _why(lab, u, n) for u in pending
                          for n in (lab.nodes if u == gid else [where[u]])}, indent=1, default=str))
    wait_each_ready(lambda u: resync_ready(A, u, gid), where, 120, "every unit at a resynced from b",
                    on_timeout=why)


def _why(lab, unit_id: str, node: str) -> dict:
    """What a unit that is not yet home is waiting on, at each site (printed on a timeout)."""
    out = {}
    for site in ("a", "b"):
        st, c = find_state(lab.pool(node, site), unit_id), find_control(lab.pool(node, site), unit_id)
        out[site] = {
            "state": st and {k: getattr(st, k) for k in ("role", "epoch", "generation", "diverged", "resync_requested")},
            "control": c and {k: getattr(c, k) for k in ("last_error", "consecutive_failures", "syncs_total",
                                                        "failures_total", "last_sync_time", "last_attempt")}}
    return out
