"""The README's main job, `drsvc demo`, and its lifecycle: `--keep`, then the printed
`drsvc demo down --root DIR` leaves nothing behind.

One run of the whole demo on real parts (two sites, redis, sshd, Celery, the playbooks): the
teardown it does without `--keep` is the lab's, which `down` runs and every lab test ends with.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from drsvc_lab import alive, leftovers, listening
from tests.fixtures.sites import need_lab


def _drsvc(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "drsvc_cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_demo_reads_for_people_keeps_then_down_leaves_nothing(tmp_path):
    """One demo, piped (rich tables at 120 columns, no Python reprs) and kept: its report
    (`DIR/demo.json`, what `--json` prints) checked, the next commands it prints run, then
    `drsvc demo down` leaves nothing behind, twice (repeat-safe)."""
    need_lab()
    root = (tmp_path / "demo").resolve()
    before = leftovers(root)
    assert not any(before.values()), before
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    doc: dict = {}
    try:
        p = _drsvc("demo", "--keep", "--root", str(root), env=env)
        _reads_for_people(p)
        doc = json.loads((root / "demo.json").read_text())
        assert doc["ok"] is True, json.dumps(doc, indent=1)[-3000:]
        _report_holds(doc)
        sites = _kept(doc, root)
        _next_commands_run(doc, root)
    finally:
        argv = shlex.split(doc.get("down") or f"drsvc demo down --root {root}")
        assert argv[:3] == ["drsvc", "demo", "down"]
        d = _drsvc(*argv[1:], timeout=300)
    assert d.returncode == 0, d.stdout + d.stderr
    assert leftovers(root) == before
    for s in sites.values():
        assert not alive(s["redis_pid"]) and not alive(s["sshd_pid"]), s
        assert not listening(s["redis_port"]) and not listening(s["sshd_port"]), s
    assert not root.exists()
    # repeat-safe: a second `down` finds nothing and succeeds
    again = _drsvc(*argv[1:], "--json", timeout=120)
    assert again.returncode == 0 and json.loads(again.stdout)["removed"] is False, again.stdout


def _reads_for_people(p) -> None:
    out = p.stdout
    assert p.returncode == 0, out[-4000:] + p.stderr[-2000:]
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 120, max(lines, key=len)
    assert not re.search(r"\{'|\['|': |\"msg\"|Traceback", out), out
    assert "drsvc demo: PASSED" in out
    # the per-sync table: what the app wrote, what changed, what went on the wire, and rsync's bytes
    header = next(ln for ln in lines if "drsvc sent" in ln)
    assert all(w in header for w in ("app wrote", "changed", "took", "rsync sent")), header
    assert sum(1 for ln in lines if re.search(r"MiB .* MiB .* MiB .*\d+\.\d+x", ln)) >= 3
    assert out.count("b is primary at epoch 1 (HEALTHY)") == 2 and "UNKNOWN" not in out


def _report_holds(doc: dict) -> None:
    assert [s["ok"] for s in doc["steps"]] == [True] * len(doc["steps"]) and len(doc["steps"]) >= 8
    # every file written at a is identical at b, on all four volumes
    assert doc["checksums"]["a"] == doc["checksums"]["b"] and len(doc["checksums"]["a"]) == 4
    # the database syncs: deltas carry the changed blocks, not the image; rsync for the same change
    syncs = doc["syncs"]
    assert len(syncs) >= 3
    for s in syncs:
        assert s["bytes_changed"] >= 0.9 * s["app_bytes"], s            # what the app wrote did change
        assert s["bytes_on_wire"] <= 1.05 * s["bytes_changed"] + (256 << 10), s   # and only that travels
        assert s["bytes_on_wire"] < (1 << 30) // 2, s                   # never the 1 GiB image
    for s in syncs[1:]:      # scattered 8 KiB page rewrites: rsync's blocks are bigger than a page
        assert s["rsync"] is not None and s["rsync"]["bytes_sent"] > s["bytes_on_wire"], s
    # the planned failover reads HEALTHY at the new primary, never UNKNOWN
    failover = next(s for s in doc["steps"] if s["step"].startswith("planned failover"))
    assert set(failover["detail"]) == {"group (Ansible)", "volume (CLI)"}, failover
    said = " ".join(failover["detail"].values())
    assert said.count("b is primary at epoch 1 (HEALTHY)") == 2 and "UNKNOWN" not in said, said


def _kept(doc: dict, root: Path) -> dict:
    """The sites run, and the checks after `down` can see them."""
    kept = leftovers(root)
    assert kept["mounts"] and kept["loop_devices"] and kept["processes"], kept
    sites = doc["sites"]
    assert all(alive(s["redis_pid"]) and alive(s["sshd_pid"]) for s in sites.values()), sites
    assert all(Path(s["config"]).exists() for s in sites.values())
    assert doc["down"] == f"drsvc demo down --root {shlex.quote(str(root))}"
    return sites


def _next_commands_run(doc: dict, root: Path) -> None:
    """It ends with ready-to-paste commands: status, a drill with the demo's inventory, Flower, teardown."""
    nxt = doc["next"]
    assert nxt["teardown"] == doc["down"] and "drsvc flower --config" in nxt["flower"]
    assert f"-i {root / 'inventory.yml'}" in nxt["drill"] and (root / "inventory.yml").exists(), nxt
    for key in ("status", "drill"):
        r = subprocess.run(["bash", "-c", nxt[key]], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (key, r.stdout[-3000:], r.stderr[-2000:])
        if key == "drill":
            assert "verification passed" in r.stdout and "no_log" not in r.stdout + r.stderr, r.stdout
