"""A site-wide failover from the runbook CLI: site a is lost while its units replicate, and
`drsvc promote --all --force` at b takes over every unit b holds as secondary (volumes and
groups) in one call of b's Site service (PromoteAll: one batch on b's control worker), each
promoted as the PromoteVolume a csi-addons controller sends would promote it
(kubernetes-csi-addons internal/controller/replication.storage/volumereplication_controller.go,
markVolumeAsPrimary with force). A dry run first changes nothing; a second run finds nothing
left to do; no unit is promoted twice (each epoch goes up by one). Then the failback's first
half at a, back with writes b never got: `drsvc demote --all --resync` (DemoteAll) demotes
and resyncs every unit there in one batch, and b's next syncs bring a's copies to b's. The same through
playbooks/site-failover.yml and its module drsvc_site: check mode lists and changes nothing; and
back again through playbooks/site-failback.yml (drsvc_site state=secondary, resync)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from csi_plugin.gen import volumegroup_pb2
from drsvc_cli.client import DrClient
from tests.ansible.test_playbooks import ansible, replicated_volume  # noqa: F401 - the fixture
from tests.dr.helpers import resync_ready, wait_each_ready, wait_synced_after, write_random
from tests.fixtures.sites import image_sha

INTERVAL = {"schedulingInterval": "2s"}
pytestmark = pytest.mark.own_lab      # it promotes every unit site b holds: no other test's may be there


def drsvc(site, *args):
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", *args, "--config", str(site.config_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def _units(lab):
    A, sa = lab.clients["a"], lab.sites["a"]
    vols = [A.create_volume(f"site{i}", 32 << 20).volume_id for i in range(3)]
    gid = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="sitegrp")).volume_group \
        .volume_group_id
    members = [A.create_volume(f"sitegrp-m{i}", 32 << 20, volumeGroup=gid).volume_id for i in range(2)]
    for v in [*vols, *members]:
        write_random(sa, v, count=3, seed=len(v))
    for v in vols:
        A.retry("EnableVolumeReplication", volume_id=v, parameters=INTERVAL)
    A.retry("EnableVolumeReplication", group_id=gid, parameters=INTERVAL)
    for v in vols:
        wait_synced_after(lab, v, [v])
    wait_synced_after(lab, gid, members)
    return vols, gid, members


def test_promote_all_takes_over_a_lost_site(lab):
    sa, sb = lab.sites["a"], lab.sites["b"]
    vols, gid, members = _units(lab)
    units = {*vols, gid}
    acked = {v: image_sha(sa, v) for v in [*vols, *members]}
    # site a is lost with its units replicating: its sshd and workers stop
    lab.stop_sshd("a")
    sa.run.stop("worker")
    before = {u["unit_id"]: u for u in drsvc(sb, "status")[1]["result"]}

    rc, dry = drsvc(sb, "promote", "--all", "--force", "--dry-run")
    assert rc == 0 and dry["result"]["changed"] is False
    assert {u["unit_id"] for u in dry["result"]["units"]} >= units
    assert all(u["role"] == "secondary" for u in drsvc(sb, "status")[1]["result"] if u["unit_id"] in units)

    rc, run = drsvc(sb, "promote", "--all", "--force", "--parallel", "4")
    r = run["result"]
    assert rc == 0 and r["failed"] == 0 and {x["unit_id"] for x in r["results"]} >= units, run
    # the batch's own answer (the unit-by-unit path reports no epoch): each unit's new epoch
    assert all(x["epoch"] == before[x["unit_id"]]["epoch"] + 1 for x in r["results"] if x["unit_id"] in units), r
    assert 0 < r["promote_p50_seconds"] <= r["promote_p99_seconds"] <= r["seconds"]
    after = {u["unit_id"]: u for u in drsvc(sb, "status")[1]["result"]}
    for u in units:
        assert after[u]["role"] == "primary" and after[u]["epoch"] == before[u]["epoch"] + 1, u
    for v, sha in acked.items():                      # what a had acked is what b took over
        assert image_sha(sb, v) == sha, v

    rc, again = drsvc(sb, "promote", "--all", "--force")
    assert rc == 0 and again["result"]["units"] == 0 and again["result"]["changed"] is False
    assert {u: after[u]["epoch"] for u in units} == \
        {u: x["epoch"] for u, x in ((x["unit_id"], x) for x in drsvc(sb, "status")[1]["result"]) if u in units}

    # site a comes back with its units still primary there, and a write b never got (taken
    # after the cut); b has written too. `demote --all --resync` at a is the failback's first
    # half, as Ramen's failback demotes and resyncs each VolumeReplication at the old primary
    # (volumereplication_controller.go: markVolumeAsSecondary, then resync with force)
    write_random(sa, vols[0], count=2, seed=77)
    write_random(sb, vols[1], count=2, seed=78)
    lab.start_sshd("a")
    rc, dry = drsvc(sa, "demote", "--all", "--resync", "--dry-run")
    assert rc == 0 and dry["result"]["changed"] is False and {u["unit_id"] for u in dry["result"]["units"]} >= units
    assert all(u["role"] == "primary" for u in drsvc(sa, "status")[1]["result"] if u["unit_id"] in units)
    rc, back = drsvc(sa, "demote", "--all", "--resync")
    r = back["result"]
    assert rc == 0 and r["failed"] == 0 and r["demoted"] >= len(units), back
    mine = {x["unit_id"]: x for x in r["results"] if x["unit_id"] in units}
    # b is primary: no final sync could land, so each copy at a is marked diverged and resynced
    assert set(mine) == units and all(not x["final_sync"] and x["resync"] in ("requested", "ready")
                                      for x in mine.values()), r
    A = lab.clients["a"]

    wait_each_ready(lambda u: resync_ready(A, u, gid), units, 90, "every unit at a resynced from b")
    for v in [*vols, *members]:                       # a follows b again: its divergence is gone
        assert image_sha(sa, v) == image_sha(sb, v), v
    assert all(u["role"] == "secondary" for u in drsvc(sa, "status")[1]["result"] if u["unit_id"] in units)
    rc, again = drsvc(sa, "demote", "--all", "--resync")
    assert rc == 0 and again["result"]["units"] == 0 and again["result"]["changed"] is False


def test_promote_all_is_refused_with_a_unit_named():
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "promote", "--all", "--volume", "v", "--json",
                        "--endpoint", "/nonexistent.sock"], capture_output=True, text=True, timeout=60)
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 2 and "--all takes every unit" in doc["error"]["message"]


def test_site_failover_check_mode_then_takeover(lab, ansible):  # noqa: F811
    sa, sb = lab.sites["a"], lab.sites["b"]
    vids = [replicated_volume(lab, ansible, "pbsite0", seed=20)]
    with DrClient(sb.endpoint) as b:
        epochs = {v: b.status(volume_id=v)["epoch"] for v in vids}
    sa.run.down()
    lab.stop_sshd("a")
    common = dict(primary_site="a", secondary_site="b")

    out = ansible.playbook("site-failover.yml", check=True, **common)
    assert "1 unit(s) at b would be promoted (check mode)" in out, out
    with DrClient(sb.endpoint) as b:
        assert all(b.status(volume_id=v)["role"] == "secondary" for v in vids)

    out = ansible.playbook("site-failover.yml", **common)
    assert "promoted 1 of 1 unit(s) at b" in out, out
    with DrClient(sb.endpoint) as b:
        for v in vids:
            st = b.status(volume_id=v)
            assert (st["role"], st["epoch"]) == ("primary", epochs[v] + 1), st
            assert image_sha(sb, v) == image_sha(sa, v)
    # again: nothing is left to promote
    r = ansible.module("drsvc_site", endpoint=sb.endpoint, state="primary", force=True)
    assert r["changed"] is False and r["units"] == [] and r["promoted"] == 0

    # a comes back, its unit still primary there: site-failback.yml demotes and resyncs it
    lab.start_sshd("a")
    sa.run.up(("plugin", "control"))
    out = ansible.playbook("site-failback.yml", check=True, **common)
    assert "1 unit(s) at a would be demoted and resynced (check mode)" in out, out
    with DrClient(sa.endpoint) as a:
        assert all(a.status(volume_id=v)["role"] == "primary" for v in vids)
    with DrClient(sb.endpoint) as b:
        gens = {v: b.status(volume_id=v)["generation"] for v in vids}
    write_random(sb, vids[0], count=2, seed=21)       # b's writes as primary: what a must follow
    out = ansible.playbook("site-failback.yml", **common)
    assert "demoted 1 of 1 unit(s) at a" in out, out
    A = lab.clients["a"]
    wait_each_ready(lambda v: resync_ready(A, v), vids, 90, "the unit at a resynced from b")
    with DrClient(sa.endpoint) as a:
        for v in vids:
            assert a.status(volume_id=v)["role"] == "secondary" and image_sha(sa, v) == image_sha(sb, v), v
            assert a.status(volume_id=v)["generation"] > gens[v]
    r = ansible.module("drsvc_site", endpoint=sa.endpoint, state="secondary", resync=True)
    assert r["changed"] is False and r["units"] == [] and r["demoted"] == 0
