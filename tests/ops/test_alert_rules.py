"""The shipped Prometheus alert rules (deploy/monitoring/drsvc-alerts.rules.yaml): valid
(`promtool check rules`) and firing when they should (`promtool test rules`), for the primary's
lag and the DR copy's data age."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "drsvc-alerts.rules.yaml"


def rule_files(tmp_path) -> list[Path]:
    """The rules files Prometheus is given: the one file deploy/monitoring ships."""
    return [RULES]


def _promtool():
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool missing (scripts/setup.sh installs Debian's prometheus package)")
    return tool


def test_rules_pass_promtool_check(tmp_path):
    tool = _promtool()
    files = rule_files(tmp_path)
    names = [r["alert"] for f in files for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]
    assert "DrsvcDrCopyStale" in names and "DrsvcReplicationLagging" in names
    p = subprocess.run([tool, "check", "rules", *map(str, files)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_dr_copy_rule_fires_for_an_old_secondary_only(tmp_path):
    tool = _promtool()
    files = rule_files(tmp_path)
    dr = [f for f in files if "DrsvcDrCopyStale" in f.read_text()][0]
    lab = 'site="b",kind="volume",peer="a"'
    test = {
        "rule_files": [str(dr)],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": [
                # vol-old at b: 10 s interval, data age grows 15 s per step (the primary went silent)
                {"series": f'drsvc_replication_data_age_seconds{{{lab},unit="vol-old"}}', "values": "0+15x10"},
                {"series": f'drsvc_replication_interval_seconds{{{lab},unit="vol-old"}}', "values": "10x10"},
                {"series": f'drsvc_replication_role{{{lab},unit="vol-old",role="secondary"}}', "values": "1x10"},
                # vol-new at b: fresh data
                {"series": f'drsvc_replication_data_age_seconds{{{lab},unit="vol-new"}}', "values": "5x10"},
                {"series": f'drsvc_replication_interval_seconds{{{lab},unit="vol-new"}}', "values": "10x10"},
                {"series": f'drsvc_replication_role{{{lab},unit="vol-new",role="secondary"}}', "values": "1x10"},
                # a primary's lag is the other rule's business
                {"series": 'drsvc_replication_lag_seconds{site="a",kind="volume",peer="b",unit="vol-p"}',
                 "values": "0+15x10"},
                {"series": 'drsvc_replication_interval_seconds{site="a",kind="volume",peer="b",unit="vol-p"}',
                 "values": "10x10"},
                {"series": 'drsvc_replication_role{site="a",kind="volume",peer="b",unit="vol-p",role="secondary"}',
                 "values": "0x10"},
            ],
            "alert_rule_test": [
                {"eval_time": "30s", "alertname": "DrsvcDrCopyStale", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "DrsvcDrCopyStale", "exp_alerts": [{
                    "exp_labels": {"severity": "page", "site": "b", "kind": "volume", "peer": "a",
                                   "unit": "vol-old"},
                    "exp_annotations": {"summary": "DR copy of vol-old at b is 2m 0s old"}}]},
            ],
        }],
    }
    tf = tmp_path / "test.yml"
    tf.write_text(yaml.safe_dump(test))
    p = subprocess.run([tool, "test", "rules", str(tf)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
