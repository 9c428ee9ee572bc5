"""Every CLI command through the real socket, with --json and exit codes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dr.helpers import wait_for, write_random

pytestmark = pytest.mark.own_lab      # it reads `drsvc status` of a site with nothing replicated

EXIT_RETRY, EXIT_REFUSED, EXIT_NOT_FOUND = 3, 4, 5


def drsvc(site, *args, check=True):
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", *args, "--config", str(site.config_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "{}"
    doc = json.loads(last)
    if check:
        assert p.returncode == 0, (args, p.returncode, p.stdout, p.stderr)
        assert doc["ok"] is True
    return p.returncode, doc


def test_cli_runbook_end_to_end(lab):
    sa, sb = lab.sites["a"], lab.sites["b"]
    rc, doc = drsvc(sa, "site", "status")
    assert {c["component"] for c in doc["result"]["components"]} >= {"plugin", "worker", "scheduler"}
    assert all(c["running"] for c in doc["result"]["components"])

    _, vol = drsvc(sa, "volume", "create", "cli-vol", "--size", "64M")
    vid = vol["result"]["volume_id"]
    _, grp = drsvc(sa, "group", "create", "cli-grp")
    gid = grp["result"]["group_id"]
    _, m = drsvc(sa, "volume", "create", "cli-m0", "--size", "32M", "--group", gid)
    assert m["result"]["group_id"] == gid
    _, lst = drsvc(sa, "volume", "list")
    assert {vid, m["result"]["volume_id"]} <= {v["volume_id"] for v in lst["result"]}
    _, gl = drsvc(sa, "group", "list")
    assert [g for g in gl["result"] if g["group_id"] == gid][0]["volumes"] == [m["result"]["volume_id"]]
    write_random(sa, vid, seed=4)

    # refused and not-found have their own exit codes
    rc, doc = drsvc(sa, "status", "--volume", vid, check=False)
    assert rc == EXIT_NOT_FOUND and doc["error"]["code"] == "NOT_FOUND"
    rc, doc = drsvc(sa, "status", "--volume", "vol-nope", check=False)
    assert rc == EXIT_NOT_FOUND

    _, en = drsvc(sa, "enable", "--volume", vid, "--interval", "1h")
    assert en["result"]["role"] == "primary" and en["result"]["interval_seconds"] == 3600
    _, gen = drsvc(sa, "enable", "--group", gid, "--interval", "1h")
    assert gen["result"]["kind"] == "group"
    wait_for(lambda: drsvc(sa, "status", "--volume", vid)[1]["result"]["generation"] >= 1, 60,
             what="initial sync")
    write_random(sa, vid, count=4, seed=5)
    _, sn = drsvc(sa, "sync-now", "--volume", vid, "--wait")
    assert sn["result"]["bytes_changed"] >= 4 * 65536
    _, st = drsvc(sa, "status")
    units = {r["unit_id"]: r for r in st["result"]}
    assert units[vid]["last_sync_bytes"] == sn["result"]["bytes_on_wire"]
    assert units[gid]["members"] == [m["result"]["volume_id"]]

    rc, doc = drsvc(sb, "promote", "--volume", vid, check=False)
    assert rc == EXIT_REFUSED and doc["error"]["code"] == "FAILED_PRECONDITION"
    _, dm = drsvc(sa, "demote", "--volume", vid)
    assert dm["result"]["role"] == "secondary"
    _, pr = drsvc(sb, "promote", "--volume", vid)
    assert pr["result"]["role"] == "primary" and pr["result"]["epoch"] == 1
    _, rs = drsvc(sa, "resync", "--volume", vid, "--wait")
    assert rs["result"]["ready"] is True
    _, rs = drsvc(sa, "resync", "--volume", vid, "--force", "--wait")   # a consistent copy: nothing to discard
    assert rs["result"]["ready"] is True
    _, cl = drsvc(sa, "clone", "--volume", vid, "--prefix", "drill1")
    assert cl["result"]["volumes"][0]["volume_id"] != vid
    drsvc(sa, "volume", "delete", cl["result"]["volumes"][0]["volume_id"])
    _, dis = drsvc(sb, "disable", "--volume", vid)
    assert (dis["result"]["enabled"], dis["result"]["changed"], dis["result"]["site"]) == (False, True, "b")
    rc, _ = drsvc(sa, "group", "delete", gid, check=False)
    assert rc == EXIT_REFUSED           # still replicated
    drsvc(sa, "disable", "--group", gid)
    drsvc(sa, "group", "delete", gid)


def test_cli_human_output_and_usage(lab):
    sa = lab.sites["a"]
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "status", "--config", str(sa.config_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "no replicated volumes" in p.stdout
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "promote", "--config", str(sa.config_path), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and json.loads(p.stdout.splitlines()[-1])["error"]["code"] == "USAGE"
