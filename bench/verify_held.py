"""``python -m bench.verify --held``: the sync interval a unit holds while its replica is
verified (bench/verify.py's docstring says what is measured)."""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from drsvc.replication.common import find_state
from drsvc.replication.control import find_control
from drsvc_cli.client import DrClient, RpcFailed
from drsvc_lab import Lab

MiB = 1 << 20


def _median(xs) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


class Watch:
    """Every sync of the unit at site a, as its reports and control record show them."""

    def __init__(self, pool: Path, vid: str):
        self.pool, self.vid = pool, vid
        self.seen: dict[int, dict] = {}
        self.failures: dict[str, int] = {}      # phase -> failed syncs counted in it
        self.errors: dict[str, set] = {}        # phase -> the failures' messages
        self._failed = None

    def poll(self, phase: str) -> None:
        st, c = find_state(self.pool, self.vid), find_control(self.pool, self.vid)
        if c is not None:
            if self._failed is not None and c.failures_total > self._failed:
                self.failures[phase] = self.failures.get(phase, 0) + c.failures_total - self._failed
                self.errors.setdefault(phase, set()).add(c.last_error[:160])
            self._failed = c.failures_total
        reports = st.reports if st else []
        newest = max((int(r.get("target_generation") or 0) for r in reports), default=0)
        for r in reports:
            g = int(r.get("target_generation") or 0)
            if g and g not in self.seen:
                # the control record holds the newest sync's schedule delay only
                delay = float(c.last_sync_delay) if c is not None and g == newest else None
                self.seen[g] = {"start": float(r["started_at"]), "took": float(r["duration_s"]), "phase": phase,
                                "delay": delay}

    def figures(self, phase: str) -> dict:
        rows = sorted((v for v in self.seen.values() if v["phase"] == phase), key=lambda v: v["start"])
        gaps = [b["start"] - a["start"] for a, b in zip(rows, rows[1:], strict=False)]
        every = gaps and statistics.median(gaps)
        return {"syncs": len(rows), "interval_s": _median(gaps), "interval_max_s": round(max(gaps), 3) if gaps else 0,
                "late": sum(1 for g in gaps if g > 1.5 * every), "failed": self.failures.get(phase, 0),
                "errors": sorted(self.errors.get(phase, ())),
                "delay_s": _median([r["delay"] for r in rows if r["delay"] is not None]), "duration_s": _median([r["took"] for r in rows])}


def _configure(lab: Lab, cap: str) -> None:
    sb = lab.sites["b"]
    text = sb.config_path.read_text()
    first_table = text.index("\n[") + 1
    sb.config_path.write_text(text[:first_table] + f'verify_read_rate = "{cap}"\n' + text[first_table:])


def _writer(sa, vid: str, stop: threading.Event) -> None:
    """A live volume: a few 4 KiB blocks change every 0.2 s."""
    rnd = random.Random(7)
    path = sa.pool / "images" / f"{vid}.img"
    while not stop.is_set():
        with open(path, "r+b") as f:
            for _ in range(8):
                f.seek(rnd.randrange(os.path.getsize(path) // 4096) * 4096)
                f.write(rnd.randbytes(4096))
        stop.wait(0.2)


def _phase(watch: Watch, phase: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.poll(phase)
        time.sleep(0.25)
    watch.poll(phase)


def _verifies(b: DrClient, vid: str, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        try:
            out.append(b.verify(volume_id=vid, wait=600))
        except RpcFailed as e:                # reported beside the figures, never hidden
            out.append({"result": f"error ({e.code.name}: {e.message[:120]})", "bytes_read": 0,
                        "duration_seconds": 0})


def held(args) -> int:
    lab = Lab(Path(tempfile.mkdtemp(prefix="drsvc-bench-verify-")), pool_size="8G")
    stop, vstop = threading.Event(), threading.Event()
    try:
        lab.build()
        _configure(lab, args.cap)
        lab.up()
        a, b = DrClient(lab.sites["a"].endpoint), DrClient(lab.sites["b"].endpoint)
        sa = lab.sites["a"]
        vid = a.create_volume("held", args.mib * MiB)["volume_id"]
        with open(sa.pool / "images" / f"{vid}.img", "r+b") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        t0 = time.monotonic()
        a.until_done(lambda: a.replication("EnableVolumeReplication", volume_id=vid,
                                           parameters={"schedulingInterval": f"{args.interval}s"}), wait=120)
        while (st := find_state(lab.sites["b"].pool, vid)) is None or st.generation < 2:
            time.sleep(0.5)
        print(f"lab up, {args.mib} MiB replicated, two syncs in {time.monotonic() - t0:.1f}s; "
              f"interval {args.interval}s, b's verify_read_rate {args.cap}")
        threading.Thread(target=_writer, args=(sa, vid, stop), daemon=True).start()
        watch = Watch(sa.pool, vid)
        _phase(watch, "warmup", 2 * args.interval)
        t = time.monotonic()
        _phase(watch, "plain", args.window)
        plain_s = time.monotonic() - t
        runs: list = []
        th = threading.Thread(target=_verifies, args=(b, vid, vstop, runs), daemon=True)
        t = time.monotonic()
        th.start()
        _phase(watch, "verify", args.window)
        vstop.set()
        th.join()
        verify_s = time.monotonic() - t
        _report(watch, runs, plain_s, verify_s, args)
        a.close()
        b.close()
    finally:
        stop.set()
        vstop.set()
        lab.teardown()
    return 0


def _report(watch: Watch, runs: list, plain_s: float, verify_s: float, args) -> None:
    p, v = watch.figures("plain"), watch.figures("verify")
    done = [r for r in runs if r.get("result")]
    rates = [r["bytes_read"] / r["duration_seconds"] / MiB for r in done if r["duration_seconds"]]
    print(f"phases: without a verify {plain_s:.1f}s, with verifies {verify_s:.1f}s "
          f"({len(done)} verifies: {', '.join(r['result'] for r in done)}; "
          f"read median {_median(rates)} MiB/s against a cap of {args.cap})")
    for label, f in (("without a verify", p), ("while verifying", v)):
        print(f"{label:17s}: {f['syncs']} syncs, interval median {f['interval_s']}s (max {f['interval_max_s']}s, "
              f"{f['late']} gaps over 1.5x) of {args.interval}s, schedule delay median {f['delay_s']}s, sync "
              f"duration median {f['duration_s']}s, {f['failed']} failed" +
              "".join(f"\n    failure: {e}" for e in f["errors"]))
    if p["interval_s"] == p["interval_s"] and v["interval_s"] == v["interval_s"]:
        print(f"interval held while verifying: {v['interval_s'] / p['interval_s']:.2f}x the interval without "
              f"({v['interval_s'] / args.interval:.2f}x the configured one)")
