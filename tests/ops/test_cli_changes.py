"""On a real two-site lab: every state-changing command says what changed and where
(plain and --json), group members are explicit, processes carry readable titles and answer
their liveness probes, and `site status` shows where each process logs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grpc

from tests.dr.helpers import generation, wait_for, write_random

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def run(site, *args, as_json=False, env=None):
    argv = [sys.executable, "-m", "drsvc_cli.main", *args, "--config", str(site.config_path)]
    p = subprocess.run(argv + (["--json"] if as_json else []), capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "COLUMNS": "200", **(env or {})})
    if as_json:
        return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    return p.returncode, " ".join(p.stdout.split()) + " ".join(p.stderr.split())


def both(site, *args):
    """The plain sentence, then the --json object, of one command run twice."""
    rc, line = run(site, *args)
    assert rc == 0, line
    rc, doc = run(site, *args, as_json=True)
    assert rc == 0 and doc["ok"], doc
    return line, doc["result"]


def test_commands_say_what_changed_and_where(lab):
    sa, sb = lab.sites["a"], lab.sites["b"]
    rc, line = run(sa, "volume", "create", "said", "--size", "64M")
    vid = re.search(r"volume (vol-\w+)", line).group(1)
    assert rc == 0 and line.startswith(f"site a: volume {vid} (64.0 MiB, named said) created"), line
    rc, doc = run(sa, "volume", "create", "said", "--size", "64M", as_json=True)
    assert (doc["result"]["changed"], doc["result"]["site"], doc["result"]["volume_id"]) == (False, "a", vid)
    write_random(sa, vid, seed=1)

    rc, line = run(sa, "enable", "--volume", vid, "--interval", "1h")
    assert rc == 0 and line == f"site a: replication of {vid} enabled to b every 1h00m; the initial sync is queued"
    line, res = both(sa, "enable", "--volume", vid[:12], "--interval", "1h")
    assert line == f"site a: {vid} already replicates to b every 1h00m; nothing changed"
    assert res["changed"] is False and res["site"] == "a" and res["role"] == "primary"
    wait_for(lambda: generation(sb, vid) >= 1, 90, what="the initial sync")

    # already primary: said so, nothing changed; times are RFC 3339 and durations seconds in --json
    line, res = both(sa, "promote", "--volume", vid)
    assert line == f"site a: {vid} is already primary (epoch 0); nothing changed"
    assert res["changed"] is False and res["site"] == "a"
    assert RFC3339.match(res["last_sync_time"]) and isinstance(res["last_sync_duration"], float), res
    # Enable queues the initial sync itself; the scheduler publishes the unit's next run at its
    # next reconcile (every 3 s), which a fast initial sync can beat
    st = wait_for(lambda: (d := run(sa, "status", "--volume", vid, as_json=True)[1])["result"]["next_sync_time"]
                  and d, 30, what="the scheduler to publish the next run")
    assert RFC3339.match(st["result"]["last_sync_time"]) and RFC3339.match(st["result"]["next_sync_time"])

    # a planned failover, sentence by sentence
    rc, line = run(sa, "demote", "--volume", vid)
    assert rc == 0 and line.startswith(f"site a: {vid} demoted; secondary at epoch 0 (was primary)"), line
    rc, doc = run(sb, "promote", "--volume", vid, as_json=True)
    assert rc == 0 and doc["result"]["changed"] is True and doc["result"]["site"] == "b", doc
    assert (doc["result"]["role"], doc["result"]["epoch"], doc["result"]["before"]) == \
        ("primary", 1, {"role": "secondary", "epoch": 0})
    rc, line = run(sb, "promote", "--volume", vid)
    assert line == f"site b: {vid} is already primary (epoch 1); nothing changed"
    rc, line = run(sa, "demote", "--volume", vid)
    assert line == f"site a: {vid} is already secondary (epoch 0); nothing changed"

    # sync-now and clone: a sentence, and the clones as a table
    rc, line = run(sb, "sync-now", "--volume", vid, "--wait")
    assert rc == 0 and line.startswith(f"site b: {vid} synced, generation "), line
    rc, out = run(sa, "clone", "--volume", vid, "--prefix", "said")
    assert rc == 0 and out.startswith(f"site a: 1 clone(s) of {vid} at generation "), out
    assert re.search(r"source\s*┃\s*clone\s*┃\s*size", out) and "{'" not in out, out
    rc, doc = run(sa, "clone", "--volume", vid, "--prefix", "said2", as_json=True)
    clone = doc["result"]["clones"][0]
    assert clone["source"] == vid and clone["clone"] != vid and doc["result"]["changed"] is True
    rc, line = run(sa, "volume", "delete", clone["clone"])
    assert line == f"site a: volume {clone['clone']} deleted"

    rc, line = run(sb, "disable", "--volume", vid)
    assert rc == 0 and line.startswith(f"site b: replication of {vid} to a ended"), line
    rc, doc = run(sb, "disable", "--volume", vid, as_json=True)
    assert rc == 0 and doc["result"]["changed"] is False, doc


def test_group_members_are_explicit(lab):
    """A member replicates with its group: its status is its group's (its line marked); disable,
    promote, demote, resync on it are refused naming the group, FAILED_PRECONDITION at the API.
    Disable at the CSI-Addons API stays OK: the VolumeReplication controller removes a VR's
    finalizer only after Disable succeeds (kubernetes-csi-addons
    internal/controller/replication.storage/volumereplication_controller.go), and a member's
    Enable was refused (INVALID_ARGUMENT), so there is nothing to end."""
    sa = lab.sites["a"]
    A = lab.clients["a"]
    rc, doc = run(sa, "group", "create", "members", as_json=True)
    gid = doc["result"]["group_id"]
    rc, doc = run(sa, "volume", "create", "m0", "--size", "32M", "--group", gid, as_json=True)
    vid = doc["result"]["volume_id"]
    run(sa, "enable", "--group", gid, "--interval", "1h")

    rc, out = run(sa, "status", "--volume", vid)
    assert rc == 0 and f"{vid} is a member of {gid}" in out and f"{vid} <- this volume" in out, out
    rc, doc = run(sa, "status", "--volume", vid, as_json=True)
    assert rc == 0 and doc["result"]["unit_id"] == gid and doc["result"]["member"] == vid, doc

    msg = f"{vid} is a member of {gid}; use --group {gid}"
    for cmd in (["disable"], ["promote"], ["demote"], ["resync"], ["sync-now"], ["clone"]):
        rc, doc = run(sa, *cmd, "--volume", vid, as_json=True)
        assert rc == 4 and doc["error"]["code"] == "FAILED_PRECONDITION" and msg in doc["error"]["message"], doc
        rc, line = run(sa, *cmd, "--volume", vid)
        assert rc == 4 and msg in line, line
    for method in ("PromoteVolume", "DemoteVolume", "ResyncVolume"):
        try:
            A.call(method, volume_id=vid, sidecar=True)
            raise AssertionError(f"{method} on a member answered OK")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and msg in e.details(), (method, e)
    A.call("DisableVolumeReplication", volume_id=vid, sidecar=True)     # OK: nothing to end
    rc, doc = run(sa, "status", "--group", gid, as_json=True)
    assert doc["result"]["members"] == [vid] and doc["result"]["role"] == "primary"   # the group goes on


def test_site_status_titles_and_probes(lab):
    sa = lab.sites["a"]
    rc, doc = run(sa, "site", "status", as_json=True)
    comps = {c["component"]: c for c in doc["result"]["components"]}
    assert all(c["running"] and c["log"].endswith(f"{name}.log") for name, c in comps.items()), comps
    assert all(Path(c["log"]).exists() for c in comps.values())
    rc, out = run(sa, "site", "status")
    assert rc == 0 and comps["worker"]["log"] in out.replace(" ", "") or "worker.log" in out, out

    # readable titles: pgrep -f finds each process by its role, and its config names its site
    titles = {}
    for name, want in (("plugin", "drsvc-plugin a"), ("worker", "drsvc-worker a"),
                       ("control", "drsvc-worker a control"), ("scheduler", "drsvc-scheduler a"),
                       ("metrics", "drsvc-metrics a")):
        pid = comps[name]["pid"]
        titles[name] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert titles[name].startswith(want) and str(sa.config_path) in titles[name], titles
    found = subprocess.run(["pgrep", "-f", "drsvc-worker a"], capture_output=True, text=True).stdout.split()
    assert str(comps["worker"]["pid"]) in found and str(comps["control"]["pid"]) in found, (found, titles)

    # liveness probes (deploy/): the workers answer a ping by name; a stopped one does not
    def probe(*args):
        return subprocess.run([sys.executable, "-m", "workers.probe", "--config", str(sa.config_path), *args],
                              capture_output=True, text=True, timeout=60)
    assert probe("worker", "--role", "data").returncode == 0
    assert probe("worker", "--role", "control").returncode == 0
    sa.run.stop("control")
    p = probe("worker", "--role", "control", "--timeout", "3")
    assert p.returncode == 1 and "did not answer" in p.stderr, p.stderr
    hb = sa.root / "scheduler.alive"
    assert probe("scheduler", "--heartbeat", str(hb)).returncode == 1        # never touched
    sched = subprocess.Popen([sys.executable, "-m", "workers.scheduler", "--config", str(sa.config_path),
                              "--heartbeat", str(hb)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_for(lambda: probe("scheduler", "--heartbeat", str(hb)).returncode == 0, 30,
                 what="the scheduler's heartbeat")
    finally:
        sched.terminate()
        sched.wait(timeout=30)
