"""Prometheus /metrics, Celery Flower, RPC secrets and scheduler leadership on the real lab."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from drsvc_lab import free_port, wait_port
from tests.dr.helpers import code_of, generation, wait_for, write_random


def _norm(sample: str) -> str:
    """name{b="2",a="1"} -> name{a="1",b="2"}: label order is not part of the format."""
    name, _, labels = sample.partition("{")
    parts = sorted(p for p in labels.rstrip("}").split(",") if p)
    return f"{name}{{{','.join(parts)}}}" if parts else name


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            out[_norm(sample)] = float(value)
    return out


class Metrics(dict):
    def __missing__(self, key):
        return self.get(_norm(key), None) if _norm(key) in self else super().__missing__(key)


def test_metrics_follow_syncs_and_failures(lab):
    A = lab.clients["a"]
    sa = lab.sites["a"]
    vol = A.create_volume("m", 64 << 20).volume_id
    write_random(sa, vol, seed=2)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "2s"})
    wait_for(lambda: generation(sa, vol) >= 2, 60, what="syncs")
    port = sa.cfg.metrics_port
    wait_port(port)
    m = Metrics(scrape(port))
    key = f'site="a",unit="{vol}",kind="volume",peer="b"'
    assert m[f"drsvc_replication_last_sync_timestamp_seconds{{{key}}}"] > time.time() - 60
    assert m[f"drsvc_replication_last_sync_bytes{{{key}}}"] > 0
    assert m[f"drsvc_replication_interval_seconds{{{key}}}"] == 2
    assert m[f'drsvc_replication_role{{{key},role="primary"}}'] == 1
    assert m[f'drsvc_replication_health{{{key},status="HEALTHY"}}'] == 1
    assert m[f"drsvc_replication_epoch{{{key}}}"] == 0

    # the peer's sshd goes away: failures count up, lag grows, health degrades
    lab.stop_sshd("b")
    wait_for(lambda: (Metrics(scrape(port)).get(_norm(f"drsvc_replication_sync_failures_total{{{key}}}")) or 0) >= 2, 90,
             what="failed syncs")
    lag1 = Metrics(scrape(port))[f"drsvc_replication_lag_seconds{{{key}}}"]
    m = wait_for(lambda: (m := Metrics(scrape(port)))[f"drsvc_replication_lag_seconds{{{key}}}"] > lag1 and m,
                 30, interval=0.5, what="the lag to grow while b is away")
    assert m[f'drsvc_replication_health{{{key},status="DEGRADED"}}'] == 1
    # ...and syncs catch up by themselves when it returns
    lab.start_sshd("b")
    wait_for(lambda: Metrics(scrape(port))[f'drsvc_replication_health{{{key},status="HEALTHY"}}'] == 1, 90,
             what="recovery")


def test_counters_take_in_a_scheduled_sync_that_ran_before_sync_now(lab):
    """The status counters (syncs, bytes on the wire, bytes changed) bracket every sync between
    two readings, a scheduled one included. `drsvc demo` reads its rows from them: CI once saw
    the database volume's scheduled slot fall inside a burst, so the scheduled sync carried the
    burst and the sync-now after it only 4 KiB, which the demo then reported as the burst."""
    from drsvc_cli.client import DrClient
    from workers.scheduler import enqueue_sync
    sa = lab.sites["a"]
    vol = lab.clients["a"].create_volume("cnt", 64 << 20).volume_id
    lab.clients["a"].retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    wait_for(lambda: generation(sa, vol) >= 1, 60, what="the initial sync")
    c = DrClient(sa.endpoint, timeout=120)
    # the generation lands at the commit; the sync's counters a moment later (jobs: after
    # sync_unit returns). Read them once the initial sync is counted (CI read 0 before it).
    before = wait_for(lambda: (st := c.status(volume_id=vol))["syncs_total"] >= 1 and st, 60,
                      what="the initial sync's counters")
    wrote = 0
    with open(sa.pool / "images" / f"{vol}.img", "r+b") as f:
        for i in range(32):                           # 2 MiB at distinct offsets
            f.seek(i << 20)
            wrote += f.write(os.urandom(64 << 10))
        os.fsync(f.fileno())
    enqueue_sync(str(sa.config_path), vol, 3600)      # the scheduler's job body, as at its slot
    wait_for(lambda: generation(sa, vol) >= 2, 60, what="the scheduled sync")
    r = c.until_done(lambda: c.sync_now(volume_id=vol, wait=60), wait=120)
    after = c.status(volume_id=vol)
    assert r["target_generation"] == 3 and r["bytes_changed"] < wrote, r    # the burst went before it
    assert after["syncs_total"] - before["syncs_total"] == 2, (before, after)
    changed = after["changed_bytes_total"] - before["changed_bytes_total"]
    assert wrote <= changed <= wrote + (64 << 10), (wrote, before, after)
    assert after["sent_bytes_total"] - before["sent_bytes_total"] >= changed
    key = f'site="a",unit="{vol}",kind="volume",peer="b"'
    wait_port(sa.cfg.metrics_port)
    m = Metrics(scrape(sa.cfg.metrics_port))
    assert m[f"drsvc_replication_changed_bytes_total{{{key}}}"] == after["changed_bytes_total"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("chromium missing (scripts/setup.sh installs Debian's chromium)")


def _headless(tool, *args, timeout=120):
    return subprocess.run([tool, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", "--virtual-time-budget=10000", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_flower_shows_replication_tasks_without_secrets(lab, tmp_path):
    """Flower's task list names each task for its unit and shows its args (Flower's
    `tasks_columns` option; Celery's *shadow* task name), checked in the rendered page."""
    A = lab.clients["a"]
    sa = lab.sites["a"]
    vol = A.create_volume("f", 64 << 20).volume_id
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "2s"})
    wait_for(lambda: generation(sa, vol) >= 2, 60, what="syncs")
    port = free_port()
    env = dict(os.environ, FLOWER_UNAUTHENTICATED_API="true")

    def flower():
        with open(tmp_path / "flower.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "drsvc_cli.main", "flower", "--config",
                                     str(sa.config_path), "--port", str(port)], env=env, stdout=log, stderr=log,
                                    start_new_session=True)
    p = flower()
    try:
        wait_port(port, 30)

        def synced_tasks():
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks?limit=200", timeout=5).read()
            except OSError:
                return None
            tasks = json.loads(body)
            return [t for t in tasks.values() if t.get("name") == f"drsvc.sync {vol}" and t.get("state") == "SUCCESS"]
        done = wait_for(synced_tasks, 60, interval=1, what="Flower to see completed syncs named for the unit")
        assert any(vol in (t.get("args") or "") for t in done)
        assert all("secret" not in json.dumps(t).lower() for t in done)
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/tasks", timeout=10).read().decode()
        assert 'data-column="args"' in page and 'data-column="kwargs"' in page, page[:2000]
        # the task list as a browser renders it (rows arrive by XHR): the unit id is in the rows
        tool = _chromium()
        dom = _headless(tool, "--dump-dom", f"http://127.0.0.1:{port}/tasks")
        assert dom.returncode == 0, dom.stderr[-2000:]
        rows = re.findall(r"<tr[^>]*>.*?</tr>", dom.stdout, re.S)
        assert any(f"drsvc.sync {vol}" in r and "trigger" in r for r in rows), dom.stdout[-3000:]
        shot = Path(os.environ.get("DRSVC_ARTIFACTS") or tmp_path) / "flower-tasks.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        r = _headless(tool, f"--screenshot={shot}", "--window-size=1600,900", f"http://127.0.0.1:{port}/tasks")
        assert r.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]
        # a scheduled sync's slot reads as a time, not epoch seconds
        scheduled = [t for t in done if "schedule" in (t.get("kwargs") or "")]
        assert scheduled and all(re.search(r"'scheduled_at': '\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC'", t["kwargs"])
                                 for t in scheduled), [t.get("kwargs") for t in done]
        # history is kept in the site's run directory: a restarted Flower still lists these tasks
        seen = {t["uuid"] for t in done}
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
        assert list(sa.run.run_dir.glob("flower.db*")), sorted(sa.run.run_dir.iterdir())
        p = flower()
        wait_port(port, 30)
        kept = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks?limit=1000", timeout=10).read()
        assert seen <= set(json.loads(kept)), "Flower lost its history on restart"
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=20)


def test_secrets_required_when_configured(lab):
    sa = lab.sites["a"]
    secret_file = sa.root / "rpc-secret"
    secret_file.write_text("tok-4c1d9e\n")
    os.chmod(secret_file, 0o600)
    with open(sa.config_path, "r+") as f:
        text = f.read()
        f.seek(0)
        f.write(f'secrets_file = "{secret_file}"\n' + text)
    sa.run.stop("plugin")
    sa.run.start("plugin")
    sa.run.wait_socket()
    A = lab.clients["a"]
    grpc.channel_ready_future(A.channel).result(timeout=30)
    vol = A.create_volume("s", 64 << 20).volume_id
    params = {"schedulingInterval": "1h"}
    assert code_of(lambda: A.call("EnableVolumeReplication", volume_id=vol, parameters=params)) \
        == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: A.call("EnableVolumeReplication", volume_id=vol, parameters=params,
                                  secrets={"token": "wrong"})) == grpc.StatusCode.UNAUTHENTICATED
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=params, secrets={"token": "tok-4c1d9e"})
    logs = "".join(p.read_text(errors="replace") for p in sa.run.run_dir.glob("*.log"))
    assert "tok-4c1d9e" not in logs


def _talks_to(pid: int, port: int) -> bool:
    """Whether process *pid* holds a TCP connection to 127.0.0.1:*port*."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(f.split()[2] == f"0100007F:{port:04X}" and f"socket:[{f.split()[9]}]" in inodes for f in lines)


def test_one_scheduler_acts(lab):
    sa = lab.sites["a"]
    second = subprocess.Popen([sys.executable, "-m", "workers.scheduler", "--config", str(sa.config_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the second is up and has asked Redis for the lease, which the first holds
        wait_for(lambda: _talks_to(second.pid, sa.redis_port), 30, interval=0.1,
                 what="the second scheduler to reach Redis")
        first_log = sa.run.log_file("scheduler").read_text()
        assert "is leader" in first_log
        # the first holds the lease; kill it and the second takes over within the lease
        sa.run.stop("scheduler", sig=signal.SIGKILL)
        A = lab.clients["a"]
        vol = A.create_volume("l", 64 << 20).volume_id
        A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "2s"})
        wait_for(lambda: generation(sa, vol) >= 3, 60, what="the second scheduler to take over")
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        out = second.communicate(timeout=20)[0].decode()
    assert out.count("is leader") == 1, out


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "drsvc-dashboard.json"
ALERT_RULES = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "drsvc-alerts.rules.yaml"


def _names(scraped: dict) -> set:
    return {k.split("{")[0] for k in scraped}


def test_counters_data_age_and_the_dashboard(lab):
    """syncs_total{result} and sent_bytes_total count in the sync outcome record, so a restart of
    the metrics process keeps them; data age at the secondary, lag at the primary; and every
    metric the Grafana dashboard queries is on a real site's /metrics."""
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("counted", 64 << 20).volume_id
    write_random(sa, vol, seed=7)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "2s"})
    wait_for(lambda: generation(sb, vol) >= 3, 90, what="three syncs at b")
    ka = f'site="a",unit="{vol}",kind="volume",peer="b"'
    kb = f'site="b",unit="{vol}",kind="volume",peer="a"'
    wait_port(sa.cfg.metrics_port)
    # b commits a generation before a's worker records the sync's outcome, which the counters read
    m1 = wait_for(lambda: (m := Metrics(scrape(sa.cfg.metrics_port))).get(
        _norm(f'drsvc_replication_syncs_total{{{ka},result="success"}}'), 0) >= 3 and m, 30,
        what="a's outcome records of three syncs")
    ok1 = m1[f'drsvc_replication_syncs_total{{{ka},result="success"}}']
    sent1 = m1[f"drsvc_replication_sent_bytes_total{{{ka}}}"]
    assert ok1 >= 3 and m1[f'drsvc_replication_syncs_total{{{ka},result="failure"}}'] == 0
    assert sent1 >= m1[f"drsvc_replication_last_sync_bytes{{{ka}}}"] > 0
    # lag at the primary, data age at the secondary: one meaning per name
    assert m1.get(_norm(f"drsvc_replication_lag_seconds{{{ka}}}")) is not None
    assert m1.get(_norm(f"drsvc_replication_data_age_seconds{{{ka}}}")) is None
    wait_port(sb.cfg.metrics_port)
    mb = Metrics(scrape(sb.cfg.metrics_port))
    assert mb.get(_norm(f"drsvc_replication_lag_seconds{{{kb}}}")) is None
    assert mb[f"drsvc_replication_data_age_seconds{{{kb}}}"] >= 0

    # a restart of the metrics process: the counters go on from where they were
    sa.run.stop("metrics")
    sa.run.start("metrics")

    def scraped():
        try:
            return Metrics(scrape(sa.cfg.metrics_port))
        except OSError:             # not listening yet, or still starting
            return None
    m2 = wait_for(scraped, 60, interval=0.5, what="the restarted metrics process")
    assert m2[f'drsvc_replication_syncs_total{{{ka},result="success"}}'] >= ok1
    assert m2[f"drsvc_replication_sent_bytes_total{{{ka}}}"] >= sent1
    write_random(sa, vol, count=4, seed=8)
    wait_for(lambda: Metrics(scrape(sa.cfg.metrics_port))[f"drsvc_replication_sent_bytes_total{{{ka}}}"]
             >= sent1 + 4 * 65536, 60, what="the changed blocks counted as sent")

    # the peer away: failures count, under result="failure" too
    lab.stop_sshd("b")
    try:
        wait_for(lambda: Metrics(scrape(sa.cfg.metrics_port))[f'drsvc_replication_syncs_total{{{ka},result="failure"}}']
                 >= 1, 90, what="a failed sync counted")
        reach = f'drsvc_peer_reachable{{site="a",peer="b",address="127.0.0.1:{sb.sshd_port}"}}'
        assert Metrics(scrape(sa.cfg.metrics_port))[reach] == 0
    finally:
        lab.start_sshd("b")

    # promtool's linter is content with both sites' pages (counters end in _total, every metric has help)
    for site in (sa, sb):
        page = urllib.request.urlopen(f"http://127.0.0.1:{site.cfg.metrics_port}/metrics", timeout=10).read()
        lint = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=page,
                              capture_output=True, timeout=60)
        assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()

    queried = set(re.findall(r"\b(drsvc_[a-z_]+)", DASHBOARD.read_text()))
    served = _names(m2) | _names(mb)
    assert queried and queried <= served, f"the dashboard queries {sorted(queried - served)}, not on /metrics"
    ruled = set(re.findall(r"\b(drsvc_[a-z_]+)", ALERT_RULES.read_text()))
    assert ruled and ruled <= served, f"the alert rules read {sorted(ruled - served)}, not on /metrics"
    # the site's own gauges: its pool's space, and its peer reached
    assert 0 < m2[f'drsvc_pool_free_bytes{{site="a",node="{sa.cfg.node_id}"}}'] \
        <= m2[f'drsvc_pool_size_bytes{{site="a",node="{sa.cfg.node_id}"}}']
    assert m2[f'drsvc_peer_reachable{{site="a",peer="b",address="127.0.0.1:{sb.sshd_port}"}}'] == 1
    json.loads(DASHBOARD.read_text())
