"""The DR site knows its data age: receive records, status, Admin and /metrics at the secondary.

Compare `rbd mirror image status` on a non-primary image (`up+replaying`, `last_update`) and
VolSync's ReplicationDestination `status.lastSyncTime`: the receiving side reports from what it
received. GetVolumeReplicationInfo stays FAILED_PRECONDITION on a secondary, as the seed says
(kubernetes-csi-addons internal/controller/replication.storage/volumereplication_controller.go
calls it only on the primary).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc

from drsvc.replication.control.health import assess_secondary, roll_forward
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import code_of, generation, wait_for, write_random
from tests.ops.test_monitoring import Metrics, scrape

INTERVAL = 2


def test_assess_secondary_pure():
    rec = [{"generation": 3, "txid": "t", "received_at": 1000.0, "duration_s": 0.5, "bytes": 42,
            "captured_at": 999.0}]
    h = assess_secondary(now=1003.0, interval=10, generation=3, received=rec)
    assert (h.status, h.data_age_seconds, h.silent_intervals, h.last_bytes) == ("HEALTHY", 4.0, 0, 42)
    h = assess_secondary(now=1000.0 + 26, interval=10, generation=3, received=rec, peer="a")
    assert h.status == "DEGRADED" and h.silent_intervals == 2 and "primary a silent for 2 intervals" in h.message
    assert h.data_age_seconds == 27.0
    # a freshly demoted site counts its silence from the demotion, not from an old receive
    h = assess_secondary(now=1026.0, interval=10, generation=3, received=rec, heard_at=1020.0)
    assert h.status == "HEALTHY"
    # a missing list reads as empty
    h = assess_secondary(now=5.0, interval=10, generation=0, received=None)
    assert h.status == "HEALTHY" and h.data_age_seconds == 0.0 and h.last_received_at == 0.0
    # a demoted primary holds its own generation 5 (its final sync, captured at 1010): the data
    # age counts from that capture, not 0, until a receive covers the generation held
    h = assess_secondary(now=1040.0, interval=10, generation=5, received=rec, heard_at=1035.0,
                         own_capture=1010.0)
    assert h.status == "HEALTHY" and h.data_age_seconds == 30.0 and "its own" in h.message
    h = assess_secondary(now=1040.0, interval=10, generation=5, received=None, heard_at=1035.0,
                         own_capture=1010.0)
    assert h.data_age_seconds == 30.0
    newer = rec + [dict(rec[0], generation=5, captured_at=1030.0, received_at=1031.0)]
    h = assess_secondary(now=1040.0, interval=10, generation=5, received=newer, heard_at=1035.0,
                         own_capture=1010.0)
    assert h.data_age_seconds == 10.0 and h.last_received_at == 1031.0


def test_next_run_rolls_forward_only_when_the_run_happened():
    # published run at 100, interval 10: a sync started at 101 means the run happened; next is 110
    assert roll_forward(100.0, interval=10, last_sync=101.0, now=105.0) == 110.0
    # a long sync (started 101, still the last at 125): the next run on the grid after it
    assert roll_forward(100.0, interval=10, last_sync=121.0, now=125.0) == 130.0
    # no sync since the published run: it stays in the past (overdue: the scheduler is not firing)
    assert roll_forward(100.0, interval=10, last_sync=95.0, now=130.0) == 100.0
    # a run still ahead, or nothing scheduled, is left alone
    assert roll_forward(140.0, interval=10, last_sync=135.0, now=130.0) == 140.0
    assert roll_forward(0.0, interval=10, last_sync=135.0, now=130.0) == 0.0


def _cli_status(site, vol):
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "status", "--volume", vol, "--config",
                        str(site.config_path), "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.splitlines()[-1])["result"]


def _cli_view(site, vol, columns):
    """`drsvc status` as an operator reads it (piped, so the width comes from COLUMNS)."""
    p = subprocess.run([sys.executable, "-m", "drsvc_cli.main", "status", "--volume", vol, "--config",
                        str(site.config_path)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COLUMNS=str(columns)))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_secondary_degrades_when_primary_is_silent_and_recovers(lab):
    """The primary's scheduler is paused (SIGSTOP), and the
    secondary turns DEGRADED with a growing data age in all three surfaces, `drsvc status`
    (JSON and the table), the Admin service and /metrics; then it recovers on SIGCONT."""
    from drsvc_cli.client import DrClient
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("age", 64 << 20).volume_id
    write_random(sa, vol, seed=7)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": f"{INTERVAL}s"})
    wait_for(lambda: generation(sb, vol) >= 2, 90, what="syncs to land at b")

    # the contract: one receive record per committed generation, newest last
    st = find_state(sb.pool, vol)
    rec = st.received[-1]
    # after_answer: what a peer acking at its commit marker did once it had answered
    assert set(rec) == {"generation", "txid", "received_at", "duration_s", "bytes", "captured_at", "after_answer"}
    assert set(rec["after_answer"]) == {"undo_wait_s", "apply_s", "undo_s", "undo_ahead_s", "behind_s"}
    assert rec["generation"] == st.generation and rec["txid"] == st.txid and rec["bytes"] > 0
    assert rec["captured_at"] <= rec["received_at"] and rec["duration_s"] >= 0
    assert [r["generation"] for r in st.received] == sorted(r["generation"] for r in st.received)

    bc = DrClient(sb.endpoint)
    s = bc.status(volume_id=vol)
    assert s["role"] == "secondary" and s["status"] == "HEALTHY", s
    assert s["last_sync_bytes"] > 0 and s["last_sync_time"] > 0
    assert code_of(lambda: B.call("GetVolumeReplicationInfo", volume_id=vol)) == \
        grpc.StatusCode.FAILED_PRECONDITION

    key = f'site="b",unit="{vol}",kind="volume",peer="a"'
    port = sb.cfg.metrics_port
    # pause the primary's scheduler: no sync is queued, the secondary must notice
    sched = sa.run.pid("scheduler")
    os.kill(sched, signal.SIGSTOP)
    try:
        wait_for(lambda: bc.status(volume_id=vol)["status"] == "DEGRADED", 60, interval=0.5,
                 what="the secondary to report the silent primary")
        s1 = bc.status(volume_id=vol)
        assert "primary a silent for" in s1["status_message"] and s1["missed_intervals"] >= 2, s1
        m1 = Metrics(scrape(port))
        c1 = _cli_status(sb, vol)
        s2 = wait_for(lambda: (s := bc.status(volume_id=vol))["missed_intervals"] > s1["missed_intervals"] and s,
                      INTERVAL * 5, interval=0.2, what="one more missed interval")
        m2 = Metrics(scrape(port))
        c2 = _cli_status(sb, vol)
        assert s2["lag_seconds"] > s1["lag_seconds"] and s2["missed_intervals"] >= s1["missed_intervals"]
        assert m2[f"drsvc_replication_data_age_seconds{{{key}}}"] > m1[f"drsvc_replication_data_age_seconds{{{key}}}"]
        assert m2[f'drsvc_replication_health{{{key},status="DEGRADED"}}'] == 1
        assert m2[f"drsvc_replication_missed_intervals{{{key}}}"] >= 2
        assert c2["status"] == "DEGRADED" and c2["lag_seconds"] > c1["lag_seconds"]
        # the three surfaces read the same records: /metrics' data age lies between two Admin reads
        assert s1["lag_seconds"] <= m2[f"drsvc_replication_data_age_seconds{{{key}}}"] <= \
            bc.status(volume_id=vol)["lag_seconds"]
        for cols in (80, 160):
            view = _cli_view(sb, vol, cols)
            assert "DEGRADED" in view and vol in view and "silent for" in " ".join(view.split()), view
        assert code_of(lambda: B.call("GetVolumeReplicationInfo", volume_id=vol)) == \
            grpc.StatusCode.FAILED_PRECONDITION
    finally:
        os.kill(sched, signal.SIGCONT)
    wait_for(lambda: bc.status(volume_id=vol)["status"] == "HEALTHY", 90, interval=0.5, what="recovery")
    s3 = bc.status(volume_id=vol)
    assert s3["lag_seconds"] < s2["lag_seconds"] and s3["missed_intervals"] == 0
    wait_for(lambda: Metrics(scrape(port))[f'drsvc_replication_health{{{key},status="HEALTHY"}}'] == 1, 30,
             what="/metrics to recover")
    m3 = Metrics(scrape(port))
    assert m3[f"drsvc_replication_data_age_seconds{{{key}}}"] < m2[f"drsvc_replication_data_age_seconds{{{key}}}"]
    assert m3[f"drsvc_replication_missed_intervals{{{key}}}"] == 0
    c3 = _cli_status(sb, vol)
    assert c3["status"] == "HEALTHY" and c3["lag_seconds"] < c2["lag_seconds"], c3
    bc.close()
