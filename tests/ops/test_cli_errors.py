"""Exit codes that mean what the README says, per command, in plain and --json output.

README: 0 success, 1 failure, 2 usage or invalid argument, 3 retryable, 4 refused, 5 not found.
Each case is an issue-11 regression: deletes of missing ids answered `deleted: True` (exit 0),
`--size 10Q` was a ValueError (exit 1), `--size 0`/`12345` made 1 GiB/1 MiB silently,
`volume delete --config A.toml ID` was refused by argparse, `sync-now --wait` at a secondary
exited 0 as a Celery SUCCESS, a missing config file exited 1, usage errors ignored --json.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from tests.dr.helpers import generation, wait_for, write_random

pytestmark = pytest.mark.own_lab      # its tests list a site's volumes and replications and expect only their own

USAGE, RETRY, REFUSED, NOT_FOUND = 2, 3, 4, 5


def run(args, *, as_json: bool):
    argv = [sys.executable, "-m", "drsvc_cli.main", *args]
    if as_json:
        argv.append("--json")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "COLUMNS": "120"})
    doc = json.loads(p.stdout.strip().splitlines()[-1]) if as_json and p.stdout.strip() else None
    return p, doc


def check(args, code, *, error=None, message=None):
    """The same exit code in both outputs; --json carries it, plain prints an error line."""
    p, doc = run(args, as_json=True)
    assert p.returncode == code, (args, p.returncode, p.stdout, p.stderr)
    assert doc["ok"] is False and doc["exit_code"] == code, doc
    if error:
        assert doc["error"]["code"] == error, doc
    if message:
        assert message in doc["error"]["message"], doc
    assert "Traceback" not in p.stderr
    p, _ = run(args, as_json=False)
    assert p.returncode == code, (args, p.returncode, p.stdout, p.stderr)
    assert "error (" in p.stderr and "Traceback" not in p.stderr, p.stderr
    return doc


def test_usage_errors_without_a_site(tmp_path):
    missing = str(tmp_path / "nope.toml")
    for bad in ("10Q", "0", "12345", "-1G", "G", "1.5.2G", "10Gx"):
        check(["volume", "create", "v", "--size", bad, "--config", missing], USAGE, error="USAGE",
              message="--size")
    check(["volume", "delete", "--config", missing, "vol-x"], USAGE, message=f"config file {missing} does not exist")
    check(["status", "--config", missing], USAGE, message="does not exist")
    check(["site", "status", "--config", missing], USAGE, message="does not exist")
    check(["volume", "delete", "--config", missing], USAGE, message="required: ID")
    check(["promote", "--config", missing], USAGE, message="exactly one of --volume or --group")
    check(["enable", "--volume", "v", "--group", "g", "--config", missing], USAGE)
    check(["status", "--bogus"], USAGE, message="unrecognized arguments")
    check(["frobnicate"], USAGE, message="invalid choice")
    check(["demo", "down"], USAGE, message="--root")
    # --config and --endpoint name two sites: which one was meant? (neither may win silently)
    doc = check(["status", "--config", missing, "--endpoint", "unix:///run/b.sock"], USAGE, message="not both")
    assert "--endpoint unix:///run/b.sock" in doc["error"]["message"]
    check(["promote", "--volume", "v", "--endpoint", "unix:///run/b.sock", "--config", missing], USAGE,
          message="not both")


def test_an_unreachable_socket_says_so_and_what_to_run(tmp_path):
    """Not rc 3 with raw gRPC text: which socket, why, and the command that shows the site's
    processes (and their logs)."""
    gone = tmp_path / "gone.sock"
    doc = check(["status", "--endpoint", f"unix://{gone}"], RETRY, error="UNAVAILABLE", message="unreachable")
    assert str(gone) in doc["error"]["message"] and "drsvc site status --config" in doc["error"]["message"]
    # a socket file nobody listens on (a plugin that died)
    import socket as so
    dead = tmp_path / "dead.sock"
    s = so.socket(so.AF_UNIX)
    s.bind(str(dead))
    s.close()
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'site = "a"\npool = "{tmp_path}/pool"\nendpoint = "unix://{dead}"\n')
    doc = check(["promote", "--volume", "vol-x", "--config", str(cfg), "--timeout", "2"], RETRY,
                error="UNAVAILABLE", message="nothing answered")
    assert f"drsvc site status --config {cfg}" in doc["error"]["message"]


def test_exit_codes_against_a_site(lab):
    sa, sb = lab.sites["a"], lab.sites["b"]
    A, B = str(sa.config_path), str(sb.config_path)
    # not found: deletes of missing ids, any option order
    check(["volume", "delete", "--config", A, "vol-doesnotexist"], NOT_FOUND, error="NOT_FOUND")
    check(["volume", "delete", "vol-doesnotexist", "--config", A], NOT_FOUND)
    check(["group", "delete", "--config", A, "grp-nope"], NOT_FOUND, error="NOT_FOUND")
    for cmd in (["status"], ["enable"], ["disable"], ["promote"], ["demote"], ["resync"], ["sync-now", "--wait"],
                ["clone"]):
        check(cmd + ["--volume", "vol-nope", "--config", A], NOT_FOUND)
        check(cmd + ["--config", A, "--group", "grp-nope"], NOT_FOUND)
    # bad size against a live site too; nothing is created
    check(["volume", "create", "sz", "--config", A, "--size", "10Q"], USAGE)
    p, doc = run(["volume", "list", "--config", A], as_json=True)
    assert doc["result"] == []
    # sizes with either suffix family
    p, doc = run(["volume", "create", "--size", "64Mi", "--config", A, "db"], as_json=True)
    assert p.returncode == 0 and doc["result"]["capacity_bytes"] == 64 << 20, doc
    vid = doc["result"]["volume_id"]
    p, doc = run(["volume", "create", "db2", "--config", A, "--size", "32M"], as_json=True)
    assert doc["result"]["capacity_bytes"] == 32 << 20
    vid2 = doc["result"]["volume_id"]
    # a unique prefix stands for the id; an ambiguous one is a usage error naming the matches
    doc = check(["status", "--config", A, "--volume", "vol-"], USAGE, message="ambiguous")
    assert vid in doc["error"]["message"] and vid2 in doc["error"]["message"]
    p, doc = run(["volume", "delete", "--config", A, vid2[:12]], as_json=True)
    assert p.returncode == 0 and doc["result"] == {"volume_id": vid2, "deleted": True, "changed": True,
                                                   "site": "a"}, doc

    write_random(sa, vid, seed=3)
    p, doc = run(["enable", "--config", A, "--volume", vid[:10], "--interval", "1h"], as_json=True)
    assert p.returncode == 0 and doc["result"]["unit_id"] == vid
    wait_for(lambda: generation(sb, vid) >= 1, 90, what="the initial sync at b")
    # sync-now at the secondary is refused before any task is queued
    r = redis.Redis(host="127.0.0.1", port=sb.redis_port)
    before = sorted(r.keys("celery-task-meta-*"))
    doc = check(["sync-now", "--config", B, "--volume", vid, "--wait"], REFUSED, error="FAILED_PRECONDITION")
    assert "secondary" in doc["error"]["message"]
    assert sorted(r.keys("celery-task-meta-*")) == before
    # refused elsewhere too: promote without the peer's demotion
    check(["promote", "--config", B, "--volume", vid], REFUSED)
    p, doc = run(["sync-now", "--config", A, "--volume", vid[:12], "--wait"], as_json=True)
    assert p.returncode == 0 and doc["result"]["target_generation"] >= 2, doc
