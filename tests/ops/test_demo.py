"""The README's main job: `drsvc demo --json` on this host."""
import json
import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path):
    from tests.fixtures.sites import need_lab
    need_lab()
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "demo", "--json", "--root", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=600)
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and doc["ok"] is True, json.dumps(doc, indent=1)[-3000:]
    assert [s["ok"] for s in doc["steps"]] == [True] * len(doc["steps"]) and len(doc["steps"]) >= 8
    # the checksums compared: every file written at a is identical at b
    assert doc["checksums"]["a"] == doc["checksums"]["b"] and len(doc["checksums"]["a"]) == 4
