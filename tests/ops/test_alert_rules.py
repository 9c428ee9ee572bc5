"""The shipped Prometheus alert rules (deploy/monitoring/drsvc-alerts.rules.yaml): valid
(`promtool check rules`), and each one through `promtool test rules` over synthetic series:
it fires on its condition, not before, and clears on the next success (alerts that never
clear are what operators of other DR tools complain of). The PrometheusRule of
deploy/components/monitoring carries the same groups; tests/ops/test_monitoring.py checks
that every metric the rules read is on a real site's /metrics."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "drsvc-alerts.rules.yaml"


def rule_files(tmp_path) -> list[Path]:
    """The rules files Prometheus is given: the one file deploy/monitoring ships."""
    return [RULES]


def _promtool():
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: scripts/setup.sh installs Debian's prometheus package"
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
                    "exp_annotations": {"summary": "DR copy of vol-old at b is 2m 0s old",
                                        "runbook": "docs/runbooks.md#drsvcdrcopystale"}}]},
            ],
        }],
    }
    tf = tmp_path / "test.yml"
    tf.write_text(yaml.safe_dump(test))
    p = subprocess.run([tool, "test", "rules", str(tf)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


PROMETHEUS_RULE = RULES.parents[1] / "components" / "monitoring" / "prometheusrule.yaml"
VOL = {"site": "a", "unit": "vol-1", "kind": "volume", "peer": "b"}


def _series(name: str, values: str, **labels) -> dict:
    lab = ",".join(f'{k}="{v}"' for k, v in {**VOL, **labels}.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


def _run(tmp_path, series: list[dict], checks: list[tuple[str, str, list[tuple[dict, str]]]],
         interval: str = "15s") -> None:
    """*checks*: (eval time, alert, [(an expected alert's labels, its summary)])."""
    def exp(name, alerts):
        return [{"exp_labels": lab, "exp_annotations": {"summary": summary,
                                                        "runbook": f"docs/runbooks.md#{name.lower()}"}}
                for lab, summary in alerts]
    test = {"rule_files": [str(RULES)], "evaluation_interval": interval,
            "tests": [{"interval": interval, "input_series": series,
                       "alert_rule_test": [{"eval_time": t, "alertname": name, "exp_alerts": exp(name, alerts)}
                                           for t, name, alerts in checks]}]}
    tf = tmp_path / "test.yml"
    tf.write_text(yaml.safe_dump(test))
    p = subprocess.run([_promtool(), "test", "rules", str(tf)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_alert_has_a_runbook_entry_and_the_operator_rule_is_the_same():
    doc = yaml.safe_load(RULES.read_text())
    runbooks = (RULES.parents[2] / "docs" / "runbooks.md").read_text()
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        anchor = rule["annotations"]["runbook"].split("#")[1]
        assert f"### {rule['alert']}" in runbooks and anchor == rule["alert"].lower(), rule["alert"]
    assert yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]["groups"] == doc["groups"]


def test_lagging_at_the_primary_fires_past_three_intervals_and_clears_on_a_sync(tmp_path):
    # 60 s interval; lag grows 15 s a step from 0 and a sync at step 20 (5 min) brings it back to 0
    page = {**VOL, "severity": "page"}
    _run(tmp_path, [_series("drsvc_replication_lag_seconds", "0+15x19 0+15x10"),
                    _series("drsvc_replication_interval_seconds", "60x30"),
                    _series("drsvc_replication_role", "1x30", role="primary")],
         [("3m", "DrsvcReplicationLagging", []),         # 180 s: not yet over 3 intervals
          ("4m30s", "DrsvcReplicationLagging", [(page, "vol-1 at a is 4m 30s behind")]),  # over since 3m15s, for 1m
          ("5m15s", "DrsvcReplicationLagging", [])])      # the sync landed at 5m


def test_a_stale_dr_copy_clears_when_the_next_generation_lands(tmp_path):
    b = {"site": "b", "peer": "a"}
    _run(tmp_path, [_series("drsvc_replication_data_age_seconds", "0+15x19 5x10", **b),
                    _series("drsvc_replication_interval_seconds", "60x30", **b),
                    _series("drsvc_replication_role", "1x30", role="secondary", **b)],
         [("4m30s", "DrsvcDrCopyStale", [({**VOL, **b, "severity": "page"}, "DR copy of vol-1 at b is 4m 30s old")]),
          ("5m15s", "DrsvcDrCopyStale", [])])


def test_failing_syncs_fire_at_three_and_clear_on_a_success(tmp_path):
    _run(tmp_path, [_series("drsvc_replication_consecutive_failures", "0 1 2 3 4 5 0 0")],
         [("30s", "DrsvcSyncFailing", []), ("45s", "DrsvcSyncFailing", [({**VOL, "severity": "warning"}, "vol-1 at a: 3 syncs to b failed in a row")]),
          ("1m30s", "DrsvcSyncFailing", [])])


def test_split_brain_at_a_primary_fires_and_clears_after_the_resync(tmp_path):
    _run(tmp_path, [_series("drsvc_replication_health", "0 0 1 1 1 0 0", status="ERROR"),
                    _series("drsvc_replication_role", "1 1 1 1 1 0 0", role="primary")],
         [("15s", "DrsvcSplitBrain", []), ("30s", "DrsvcSplitBrain", [({**VOL, "severity": "page", "status": "ERROR"}, "vol-1: a and b are both primary")]),
          ("1m15s", "DrsvcSplitBrain", [])])


def test_an_unreachable_peer_fires_after_two_minutes_and_clears_when_it_answers(tmp_path):
    peer = {"site": "a", "peer": "b", "address": "10.0.0.2:22"}
    s = {"series": "drsvc_peer_reachable{" + ",".join(f'{k}="{v}"' for k, v in peer.items()) + "}",
         "values": "1 0x12 1x4"}
    _run(tmp_path, [s], [("1m", "DrsvcPeerUnreachable", []),
                         ("2m30s", "DrsvcPeerUnreachable", [({**peer, "severity": "warning"},
                                                                             "a cannot reach peer b at 10.0.0.2:22")]),
                         ("3m30s", "DrsvcPeerUnreachable", [])])


def test_a_nearly_full_pool_fires_under_a_tenth_free_and_clears_when_space_is_freed(tmp_path):
    pool = {"site": "b", "node": "b-node"}
    lab = ",".join(f'{k}="{v}"' for k, v in pool.items())
    _run(tmp_path, [{"series": f"drsvc_pool_size_bytes{{{lab}}}", "values": "1000x40"},
                    {"series": f"drsvc_pool_free_bytes{{{lab}}}", "values": "200x4 50x25 500x10"}],
         [("2m", "DrsvcPoolNearlyFull", []), ("6m45s", "DrsvcPoolNearlyFull", [({**pool, "severity": "warning"}, "pool of b (b-node) has 5% free")]),
          ("7m45s", "DrsvcPoolNearlyFull", [])])


def test_a_failed_verify_fires_at_once_and_clears_when_the_repair_commits(tmp_path):
    b = {"site": "b", "peer": "a"}
    _run(tmp_path, [_series("drsvc_replication_verify_failed", "0x4 1x10 0x5", **b),
                    _series("drsvc_replication_verify_mismatched_blocks", "0x4 3x10 0x5", **b)],
         [("45s", "DrsvcVerifyFailed", []),
          ("1m15s", "DrsvcVerifyFailed", [({**VOL, **b, "severity": "page"},
                                            "DR copy of vol-1 at b failed its verify: 3 block(s) differ")]),
          ("4m15s", "DrsvcVerifyFailed", [])])


def test_a_damaged_recovery_point_fires_at_once_and_clears_when_a_verify_finds_none(tmp_path):
    b = {"site": "b", "peer": "a"}
    _run(tmp_path, [_series("drsvc_replication_verify_damaged_points", "0x4 1x10 0x5", **b)],
         [("45s", "DrsvcRecoveryPointDamaged", []),
          ("1m15s", "DrsvcRecoveryPointDamaged", [({**VOL, **b, "severity": "warning"},
                                                    "1 recovery point(s) of vol-1 at b are damaged")]),
          ("4m15s", "DrsvcRecoveryPointDamaged", [])])


def test_an_overdue_verify_fires_past_one_and_a_half_intervals_and_clears_on_the_next_verify(tmp_path):
    # a 10 min verify interval: overdue past 15 min without a complete verify, for 10 min;
    # the verify that ends at 30 min clears it
    b = {"site": "b", "peer": "a"}
    _run(tmp_path, [_series("drsvc_replication_last_verify_timestamp_seconds", "0x29 1800x10", **b),
                    _series("drsvc_replication_verify_interval_seconds", "600x40", **b),
                    # a replica with no verify interval is never overdue
                    _series("drsvc_replication_last_verify_timestamp_seconds", "0x40", unit="vol-off", **b),
                    _series("drsvc_replication_verify_interval_seconds", "0x40", unit="vol-off", **b)],
         [("20m", "DrsvcVerifyOverdue", []),          # over since 15m, not yet for 10 min
          ("27m", "DrsvcVerifyOverdue", [({**VOL, **b, "severity": "warning"},
                                          "DR copy of vol-1 at b last verified 27m 0s ago")]),
          ("31m", "DrsvcVerifyOverdue", [])], interval="1m")
