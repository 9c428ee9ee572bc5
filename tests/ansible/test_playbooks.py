"""The Ansible playbooks and modules, run for real (ansible-playbook) against the two-site lab."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from drsvc_cli.client import DrClient
from tests.dr.helpers import wait_for, write_random
from tests.fixtures.sites import image_sha

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"
INTERVAL = "2s"

pytestmark = pytest.mark.skipif(shutil.which("ansible-playbook") is None, reason="ansible-core is not installed")


# -- running ansible ----------------------------------------------------------------------------
@pytest.fixture
def ansible(lab, tmp_path):
    """Runs ansible-playbook / ansible against an inventory generated from the example for this lab."""
    inv = yaml.safe_load((PLAYBOOKS / "inventory.example.yml").read_text())
    hosts = inv["all"]["children"]["drsvc_sites"]["hosts"]
    for name, site in lab.sites.items():
        h = hosts[f"site-{name}"]
        h["drsvc_endpoint"], h["drsvc_config"] = site.endpoint, str(site.config_path)
    inv["all"]["children"]["drsvc_sites"]["vars"].update(
        drsvc_wait=120, drsvc_resync_delay=1, drsvc_drill_scratch=str(tmp_path))
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    (tmp_path / "ansible-tmp").mkdir()
    env = {**os.environ, "ANSIBLE_LIBRARY": str(PLAYBOOKS / "library"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_MODULE_UTILS": str(PLAYBOOKS / "module_utils"),      # ad-hoc runs (playbooks find it)
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"), "ANSIBLE_REMOTE_TEMP": str(tmp_path / "ansible-tmp"),
           "ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_RETRY_FILES_ENABLED": "False",
           "ANSIBLE_CONFIG": str(tmp_path / "none.cfg"),   # no ansible.cfg from the cwd or home
           # the modules import drsvc_cli from the checkout, whatever the install's state
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    class Runner:
        inventory = path

        def playbook(self, name, *extra, check=False, ok=True, **evars):
            argv = ["ansible-playbook", "-i", str(path), str(PLAYBOOKS / name), "-e", json.dumps(evars), *extra]
            if check:
                argv.append("--check")
            t0 = time.monotonic()
            # each line stamped with the seconds since start: a slow step shows in a failure's output
            p = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
            lines = [f"[{time.monotonic() - t0:5.1f}s] {line}" for line in p.stdout]
            rc = p.wait(timeout=300)
            out = "".join(lines)
            print(f"{name}{' --check' if check else ''}: {time.monotonic() - t0:.1f}s")
            assert (rc == 0) == ok, f"{name} rc={rc}\n{out}"
            return out

        def module(self, module, ok=True, check=False, **args):
            """One module call through `ansible localhost -m`; returns the module's result dict."""
            argv = ["ansible", "localhost", "-i", str(path), "-m", module, "-a", json.dumps(args)]
            if check:
                argv.append("--check")
            t0 = time.monotonic()
            p = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            print(f"{module} {args.get('state', '')}: {time.monotonic() - t0:.1f}s")
            assert (p.returncode == 0) == ok, f"{module} {args} rc={p.returncode}\n{p.stdout}{p.stderr}"
            m = re.search(r"^localhost \| [A-Z!]+ => (\{.*\})\s*$", p.stdout, re.S | re.M)
            assert m, p.stdout + p.stderr
            return json.loads(m.group(1))

    return Runner()


def clients(lab):
    return DrClient(lab.sites["a"].endpoint), DrClient(lab.sites["b"].endpoint)


def roles(lab, **unit):
    a, b = clients(lab)
    with a, b:
        return a.status(**unit)["role"], b.status(**unit)["role"]


def wait_generation(client, unit, at_least, timeout=60):
    return wait_for(lambda: client.status(**unit)["generation"] >= at_least, timeout,
                    what=f"{unit} to reach generation {at_least}")


def replicated_volume(lab, ansible, name, *, seed):
    """A volume at a with random data in its image, enabled through the module, synced to b."""
    a, b = clients(lab)
    with a, b:
        vid = a.create_volume(name, 64 << 20)["volume_id"]
        write_random(lab.sites["a"], vid, seed=seed)
        endpoint = lab.sites["a"].endpoint
        r = ansible.module("drsvc_replication", endpoint=endpoint, volume_id=vid, state="enabled",
                           peer="b", interval=INTERVAL)
        assert r["changed"] and r["role"] == "primary" and r["status"]["interval_seconds"] == 2
        # enabling again alike changes nothing; a unique id prefix names the volume, as in the CLI
        again = ansible.module("drsvc_replication", endpoint=endpoint, volume_id=vid[:10], state="enabled",
                               peer="b", interval=INTERVAL)
        assert again["changed"] is False and again["action"] == "none" and again["unit_id"] == vid
        wait_generation(a, {"volume_id": vid}, 2)
    return vid


# -- planned failover, idempotency, check mode, failback -----------------------------------------
def test_planned_failover_check_mode_idempotency_and_failback(lab, ansible):
    sa, sb = lab.sites["a"], lab.sites["b"]
    vid = replicated_volume(lab, ansible, "pf", seed=1)
    unit = {"volume_id": vid}
    common = dict(primary_site="a", secondary_site="b", volume_id=vid)

    # check mode: reports the demote and promote, changes nothing
    out = ansible.playbook("planned-failover.yml", check=True, **common)
    assert re.search(r"changed: \[localhost -> site-a\]", out), out
    assert roles(lab, **unit) == ("primary", "secondary")

    # promote without a demoted peer is refused, with the plugin's reason
    r = ansible.module("drsvc_replication", ok=False, endpoint=sb.endpoint, volume_id=vid, state="primary")
    assert r["code"] == "FAILED_PRECONDITION" and "demote" in r["msg"]
    assert roles(lab, **unit) == ("primary", "secondary")

    write_random(sa, vid, count=4, seed=2)      # last writes: only the final sync carries them
    ansible.playbook("planned-failover.yml", **common)
    assert roles(lab, **unit) == ("secondary", "primary")
    assert image_sha(sa, vid) == image_sha(sb, vid)

    # the promote step again: nothing to do, changed=false (also in check mode)
    for check in (False, True):
        r = ansible.module("drsvc_replication", check=check, endpoint=sb.endpoint, volume_id=vid, state="primary")
        assert r["changed"] is False and r["action"] == "none" and r["role"] == "primary"
    r = ansible.module("drsvc_replication", endpoint=sa.endpoint, volume_id=vid, state="secondary")
    assert r["changed"] is False and r["role"] == "secondary"
    # and the whole playbook again: every step ok, none changed
    out = ansible.playbook("planned-failover.yml", **common)
    assert re.search(r"localhost\s+: ok=\d+\s+changed=0\s", out), out

    # b is primary now and replicates back to a on its schedule
    with DrClient(sb.endpoint) as b:
        gen = b.status(**unit)["generation"]
        write_random(sb, vid, count=4, seed=3)
        wait_generation(b, unit, gen + 2)
    assert image_sha(sa, vid) == image_sha(sb, vid)

    # failback in check mode changes nothing; then for real: a is primary again
    ansible.playbook("failback.yml", check=True, **common)
    assert roles(lab, **unit) == ("secondary", "primary")
    out = ansible.playbook("failback.yml", **common)
    assert roles(lab, **unit) == ("primary", "secondary")
    assert image_sha(sa, vid) == image_sha(sb, vid)


# -- unplanned failover, split brain, failback with resync ----------------------------------------
def test_unplanned_failover_and_failback_with_resync(lab, ansible):
    sa, sb = lab.sites["a"], lab.sites["b"]
    vid = replicated_volume(lab, ansible, "fo", seed=11)
    unit = {"volume_id": vid}
    common = dict(primary_site="a", secondary_site="b", volume_id=vid)
    with DrClient(sa.endpoint) as a:
        epoch0 = a.status(**unit)["epoch"]

    # site a is lost: its plugin, worker, scheduler and sshd stop
    sa.run.down()
    lab.stop_sshd("a")
    out = ansible.playbook("unplanned-failover.yml", **common)
    assert f"is primary at b at epoch {epoch0 + 1}" in out, out
    assert "unreachable" in out, out                           # the read-only probe of a
    # the forced promote again is a no-op
    r = ansible.module("drsvc_replication", endpoint=sb.endpoint, volume_id=vid, state="primary", force=True)
    assert r["changed"] is False and r["epoch"] == epoch0 + 1

    # b takes writes; a comes back still primary and writes too: split brain
    write_random(sb, vid, count=6, seed=12)
    write_random(sa, vid, count=6, seed=13)
    lab.up("a")
    lab.start_sshd("a")
    assert roles(lab, **unit) == ("primary", "primary")          # a does not know yet

    # a's first syncs after its return are refused by b (fenced); the demote waits them out (ABORTED
    # answers, retried for drsvc_wait seconds), which can take tens of seconds
    ansible.playbook("failback.yml", **common)
    assert roles(lab, **unit) == ("primary", "secondary")
    assert image_sha(sa, vid) == image_sha(sb, vid)
    with DrClient(sa.endpoint) as a:
        st = a.status(**unit)
        assert st["epoch"] == epoch0 + 2, st
        # a follows b's writes: a's own split-brain writes were discarded by the resync
        wait_generation(a, unit, st["generation"] + 2)
    assert image_sha(sa, vid) == image_sha(sb, vid)


# -- drill during scheduled replication ------------------------------------------------------------
PROBE = """\
import hashlib, json, pathlib, sys
want = json.loads(pathlib.Path(sys.argv[1]).read_text())
root = pathlib.Path(sys.argv[2])
bad = [n for n, h in want.items() if hashlib.sha256((root / n).read_bytes()).hexdigest() != h]
print("probe checked", len(want), "files; bad:", bad)
sys.exit(1 if bad else 0)
"""


def test_drill_verifies_clones_and_keeps_the_schedule(lab, ansible, tmp_path):
    a, b = clients(lab)
    with a, b:
        vid = a.create_volume("drill", 64 << 20)["volume_id"]
        unit = {"volume_id": vid}
        # real files on a real filesystem at a
        stg, mnt = tmp_path / "stg-a", tmp_path / "mnt-a"
        a.mount(vid, str(stg), str(mnt))
        try:
            (mnt / "data").mkdir()
            files = {"top.bin": os.urandom(300_000), "data/one.bin": os.urandom(1_000_000),
                     "data/two.txt": b"hello drill\n" * 1000}
            for rel, body in files.items():
                (mnt / rel).write_bytes(body)
            os.sync()
        finally:
            a.unmount(vid, str(stg), str(mnt))
        sums = {rel: hashlib.sha256(body).hexdigest() for rel, body in files.items()}
        a.until_done(lambda: a.replication("EnableVolumeReplication", volume_id=vid,
                                           parameters={"schedulingInterval": INTERVAL, "peer": "b"}), wait=60)
        wait_generation(a, unit, 2)
        before_a, before_b = a.status(**unit), b.status(**unit)
        vols_before = {v["volume_id"] for v in b.list_volumes()}

        # check mode: only reads
        ansible.playbook("drill.yml", check=True, primary_site="a", secondary_site="b", volume_id=vid)
        # the default verification with the expected checksums
        # (a unique id prefix names the volume, as in the CLI)
        out = ansible.playbook("drill.yml", "-v", primary_site="a", secondary_site="b", volume_id=vid[:12],
                               drill_expected_sha256=sums)
        assert "verification passed (rc 0) on 1 clone(s); 3 file(s) checksummed; clean-up done" in out, out
        assert "no_log" not in out, out       # Ansible's "Module did not set no_log for require_pass"
        for digest in sums.values():
            assert digest in out
        # a user-supplied probe, given the mount path as its last argument
        (tmp_path / "want.json").write_text(json.dumps(sums))
        (tmp_path / "probe.py").write_text(PROBE)
        out = ansible.playbook("drill.yml", "-v", primary_site="a", secondary_site="b", volume_id=vid,
                               drill_verify_command=[sys.executable, str(tmp_path / "probe.py"),
                                                     str(tmp_path / "want.json")])
        assert "probe checked 3 files; bad: []" in out, out
        # a failing verification fails the play, and the clones are still cleaned up
        out = ansible.playbook("drill.yml", ok=False, primary_site="a", secondary_site="b", volume_id=vid,
                               drill_expected_sha256={**sums, "top.bin": "0" * 64})
        assert "failed verification" in out and "top.bin" in out, out

        # replication kept its schedule throughout: a's last sync time and b's generation advanced
        def advanced():
            sa, sb = a.status(**unit), b.status(**unit)
            return (sa["last_sync_time"] > before_a["last_sync_time"] and sa["generation"] > before_a["generation"]
                    and sb["generation"] > before_b["generation"] and (sa, sb))
        after_a, after_b = wait_for(advanced, 30, interval=0.5, what="scheduled syncs after the drills")
        assert after_a["last_sync_time"] > before_a["last_sync_time"]
        assert after_a["generation"] > before_a["generation"]
        assert after_b["generation"] > before_b["generation"]
        # on schedule: the latest sync is recent (three intervals and slack for a loaded 2-core host)
        assert time.time() - after_a["last_sync_time"] < 3 * 2 + 5, after_a
        assert after_a["status"] in ("HEALTHY", "UNKNOWN"), after_a
        # no clone left at b, and no mount left under the scratch directory
        assert {v["volume_id"] for v in b.list_volumes()} == vols_before and vid in vols_before
        assert not [line for line in Path("/proc/mounts").read_text().splitlines() if str(tmp_path) in line]
        assert not list(tmp_path.glob("drsvc-drill-*"))
        # the replica itself was never published at b
        assert roles(lab, **unit) == ("primary", "secondary")
