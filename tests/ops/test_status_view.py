"""`drsvc status` as an operator's view: whole ids at 80 and 160 columns (piped, as in
`drsvc status | less`), human sizes and durations in UTC, the next scheduled sync, a running
sync's progress, the secondary's data age, and `--watch` until Ctrl-C. Compare `rbd mirror image
status` and `zrepl status`, which an operator reads the same way."""
from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drsvc_cli.client import DrClient
from tests.dr.helpers import generation, wait_for, write_random

pytestmark = pytest.mark.own_lab      # it reads the status of every unit of a site and expects only its own

# set DRSVC_ARTIFACTS to keep the rendered views (for a closing note); otherwise nothing is written
ARTIFACTS = Path(os.environ["DRSVC_ARTIFACTS"]) if os.environ.get("DRSVC_ARTIFACTS") else None


def cli(site, *args, columns=80, as_json=False):
    env = dict(os.environ, COLUMNS=str(columns), TERM="dumb")
    env.pop("LINES", None)
    argv = [sys.executable, "-m", "drsvc_cli.main", *args, "--config", str(site.config_path)]
    p = subprocess.run(argv + (["--json"] if as_json else []), capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.splitlines()[-1])["result"] if as_json else p.stdout


def _save(name, text):
    if ARTIFACTS is None:
        return
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / name).write_text(text)
    except OSError:
        pass


def test_status_view_whole_ids_progress_next_sync_and_watch(lab):
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    a = DrClient(sa.endpoint)
    vol = a.create_volume("orders-db", 256 << 20)["volume_id"]
    gid = a.create_group("shop")["group_id"]
    members = [a.create_volume(f"shop-{i}", 128 << 20, group_id=gid)["volume_id"] for i in range(2)]
    write_random(sa, vol, seed=1)
    write_random(sa, members[0], count=48, size=1 << 20, seed=2)      # 48 MiB to ship
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    # a bandwidth limit makes the group's initial sync last a few seconds: progress is visible
    A.retry("EnableVolumeReplication", group_id=gid,
            parameters={"schedulingInterval": "10m", "bandwidthLimit": str(8 << 20)})
    running = wait_for(lambda: (s := a.status(group_id=gid))["progress"] and s["progress"]["bytes_sent"] and s,
                       60, interval=0.1, what="a running sync's progress")
    p = running["progress"]
    assert p["bytes_planned"] >= 16 << 20 and p["bytes_sent"] < p["bytes_planned"] and p["rate_bps"] > 0, p
    text = cli(sa, "status", "--group", gid[:10], columns=80)
    if "sending" in text:     # the sync may have ended between the two reads
        assert re.search(r"sending [\d.]+ (MiB|KiB|B) of [\d.]+ MiB changed \(\d+%\), [\d.]+ (MiB|KiB)/s", text), text
    wait_for(lambda: generation(sb, gid) >= 1 and generation(sb, vol) >= 1, 120, what="initial syncs")
    wait_for(lambda: a.status(group_id=gid)["progress"] is None, 30, what="the progress file to go")
    wait_for(lambda: a.status(volume_id=vol)["next_sync_time"], 30, what="the scheduler's next run")

    ids = [vol, gid, *members]
    for site, name in ((sa, "a"), (sb, "b")):
        for cols in (80, 160):
            out = cli(site, "status", columns=cols)
            _save(f"status-{name}-{cols}.txt", out)
            assert "…" not in out and "..." not in out, out
            assert max(len(line) for line in out.splitlines()) <= cols, out
            for i in ids:
                assert i in out, (i, out)
            # sizes read for people; the last sync may be an idle one of a few bytes (a
            # repeated Enable, as a retried call under load, queues another initial sync)
            assert "UTC" in out and re.search(r"\b\d+(\.\d+)? (MiB|KiB|B)\b", out), out
        js = {r["unit_id"]: r for r in cli(site, "status", as_json=True)}
        assert set(js) == {vol, gid}
    assert "next sync" in cli(sa, "status", "--volume", vol, columns=80)
    st = {r["unit_id"]: r for r in cli(sa, "status", as_json=True)}
    # --json gives instants in RFC 3339 (UTC)
    nxt = datetime.datetime.fromisoformat(st[vol]["next_sync_time"].replace("Z", "+00:00")).timestamp()
    assert st[vol]["next_sync_time"].endswith("Z") and time.time() < nxt <= time.time() + 3600 + 5
    out_b = cli(sb, "status", "--volume", vol[:9], columns=80)
    assert "data age" in out_b and "last received" in out_b and "secondary" in out_b, out_b
    for cols in (80, 160):
        for noun in ("volume", "group"):
            out = cli(sa, noun, "list", columns=cols)
            assert "…" not in out and all(i in out for i in (members if noun == "volume" else [gid])), out

    # --watch refreshes until Ctrl-C, then exits 0
    env = dict(os.environ, COLUMNS="100")
    w = subprocess.Popen([sys.executable, "-m", "drsvc_cli.main", "status", "--watch", "--every", "0.5",
                          "--config", str(sa.config_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    seen, deadline = [], time.monotonic() + 90          # two refreshes, however loaded the machine
    while sum("replication at" in line for line in seen) < 2 and time.monotonic() < deadline:
        line = w.stdout.readline()
        if not line:
            break
        seen.append(line)
    w.send_signal(signal.SIGINT)
    out, err = w.communicate(timeout=30)
    out = "".join(seen) + out
    assert w.returncode == 0, err
    assert out.count("replication at") >= 2 and "Traceback" not in err, (out, err)
    a.close()
