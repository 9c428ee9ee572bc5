"""The runbook CLI at sites deployed as shipped: both overlays in deploy/ set `secrets_file`,
and the plugin then refuses every replication and group call without the site's token
(csi_plugin/addons_servicers.py checks `secrets` on each). The CLI reads the token from the
site config it is given and sends it with every call; the token never reaches its output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.dr.helpers import wait_for, write_random

TOKENS = {"a": "tok-a-5e0f7c2b", "b": "tok-b-91d3aa40"}


def drsvc(site, *args, endpoint=None):
    where = ["--endpoint", site.endpoint] if endpoint else ["--config", str(site.config_path)]
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", *args, *where, "--json"],
                       capture_output=True, text=True, timeout=300)
    for token in TOKENS.values():
        assert token not in p.stdout + p.stderr
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def ok(site, *args):
    rc, doc = drsvc(site, *args)
    assert rc == 0 and doc["ok"], (args, doc)
    return doc["result"]


def _require_tokens(lab):
    """Each site's config names a secrets_file, as deploy/overlays/site-{a,b}/site.toml do;
    the plugins restart to read it (the lab's heal restores the configs after the test)."""
    for name, s in lab.sites.items():
        path = s.root / "rpc-token"
        path.write_text(TOKENS[name] + "\n")
        os.chmod(path, 0o600)
        s.config_path.write_text(f'secrets_file = "{path}"\n' + s.config_path.read_text())
        s.run.stop("plugin")
        s.run.start("plugin")
        s.run.wait_socket()


def test_runbook_against_sites_with_a_token(lab):
    sa, sb = lab.sites["a"], lab.sites["b"]
    _require_tokens(lab)
    vid = ok(sa, "volume", "create", "tok-vol", "--size", "32M")["volume_id"]
    gid = ok(sa, "group", "create", "tok-grp")["group_id"]
    mid = ok(sa, "volume", "create", "tok-m0", "--size", "32M", "--group", gid)["volume_id"]
    assert [g for g in ok(sa, "group", "list") if g["group_id"] == gid][0]["volumes"] == [mid]
    write_random(sa, vid, count=2, seed=8)
    ok(sa, "enable", "--volume", vid, "--interval", "1h")
    ok(sa, "enable", "--group", gid, "--interval", "1h")
    ok(sa, "sync-now", "--volume", vid, "--wait")
    ok(sa, "sync-now", "--group", gid, "--wait")
    assert ok(sa, "status", "--group", gid)["members"] == [mid]

    # the planned failover and the resync of the old primary, as the runbook does them
    assert ok(sa, "demote", "--volume", vid)["role"] == "secondary"
    assert ok(sb, "promote", "--volume", vid)["role"] == "primary"
    assert ok(sa, "resync", "--volume", vid, "--wait")["ready"] is True
    ok(sa, "demote", "--group", gid)
    ok(sb, "promote", "--group", gid)
    wait_for(lambda: ok(sb, "status", "--group", gid)["role"] == "primary", 30, what="b's group primary")

    # without the config the CLI has no token: refused, and told where the token comes from
    rc, doc = drsvc(sb, "group", "list", endpoint=True)
    assert rc != 0 and doc["error"]["code"] == "UNAUTHENTICATED", doc
    assert "--config" in doc["error"]["message"]


def test_an_unreadable_token_file_is_a_usage_error(lab, tmp_path):
    sa = lab.sites["a"]
    missing = tmp_path / "no-token"
    cfg = tmp_path / "site.toml"
    cfg.write_text(f'secrets_file = "{missing}"\n' + sa.config_path.read_text())
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "group", "list", "--config", str(cfg), "--json"],
                       capture_output=True, text=True, timeout=60)
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode != 0 and str(missing) in doc["error"]["message"], doc
    assert "Traceback" not in p.stderr
