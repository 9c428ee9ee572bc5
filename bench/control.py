"""Control latency while many units sync: `python -m bench.control --json`.

A two-site lab (drsvc_lab: loop-mounted XFS pools, redis-server, sshd with the forced
receiver and pinned host keys), each site with its plugin, data worker (concurrency 2),
control worker and scheduler, started as `drsvc site up` starts them. --units volumes are
enabled at site a on --interval schedules, so the data worker is saturated (syncs of a few
KiB cost a fixed amount each, and more are due than it can run). A writer rewrites a few
blocks of random volumes all along.

Then --failovers planned failovers, one unit at a time: DemoteVolume at a (its final sync
included) and PromoteVolume at b, each timed as a caller sees it through the request side
(an ABORTED answer, a sync holding the unit, is retried after 0.2 s, as the csi-addons
controller requeues). EnableVolumeReplication of new volumes is timed too. The same is then
measured without the control queue (--contrast runs): control tasks sent to the data queue, where they wait behind every queued sync. That is the peer figure.

Printed per phase: enable of all units, warm-up, the failovers, the contrast; the data
worker's syncs per second and the scheduler's schedule delay over the run.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from drsvc.errors import OperationInProgress
from drsvc.model import MOUNT, Capability
from drsvc.replication.control import find_control
from drsvc.replication.common import find_state
from drsvc.site import Site
from drsvc_lab import Lab
from workers.app import make_app
from workers.client import CeleryDispatcher

MiB = 1 << 20


def pct(xs, p) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 4)


def summary(xs) -> dict:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "max": round(max(xs), 4) if xs else None}


def timed_retry(fn, *, deadline_s: float) -> float:
    """Call *fn* until it stops answering OperationInProgress (ABORTED); the wall time."""
    t = time.monotonic()
    while True:
        try:
            fn()
            return time.monotonic() - t
        except OperationInProgress:
            if time.monotonic() - t > deadline_s:
                raise
            time.sleep(0.2)


def _syncs_total(pool, vids) -> int:
    return sum(c.syncs_total for v in vids if (c := find_control(pool, v)) is not None)


def _delays(pool, vids) -> list[float]:
    return [c.last_sync_delay for v in vids if (c := find_control(pool, v)) is not None and c.last_sync_delay]


class OneQueue(CeleryDispatcher):
    """The contrast: every operation on the data queue, with no control queue."""
    def queue(self, op: str) -> str:
        return self.cfg.queue


class ControlBench:
    """The bench on a built and running lab: site services through a dispatcher, the
    volumes, a writer that keeps changing them, and the timed failovers."""

    def __init__(self, args, lab: Lab, out: dict):
        self.args, self.lab, self.out = args, lab, out
        self.rnd = random.Random(args.seed)
        self.sa, self.sb = lab.sites["a"], lab.sites["b"]
        self.A, self.B = self.open_sites(CeleryDispatcher)
        self.vids: list[str] = []
        self.stop = threading.Event()

    def open_sites(self, dispatcher):
        return [Site.from_config(s.cfg, dispatcher=dispatcher(make_app(s.cfg)), rpc_wait=600)
                for s in (self.sa, self.sb)]

    def new_volume(self, name: str) -> str:
        mib, rnd = self.args.mib, self.rnd
        v = self.A.volumes.create_volume(name, required_bytes=mib * MiB,
                                         capabilities=[Capability(MOUNT, "SINGLE_NODE_WRITER")])
        with open(self.A.pool.image(v.volume_id), "r+b") as f:       # a little data: 1% of the blocks
            for _ in range(max(1, mib * MiB // 4096 // 100)):
                f.seek(rnd.randrange(mib * MiB // 4096) * 4096)
                f.write(rnd.randbytes(4096))
        return v.volume_id

    def create_and_enable(self) -> None:
        A, t = self.A, time.monotonic()
        self.vids = [self.new_volume(f"ctl-{i:04}") for i in range(self.args.units)]
        interval = {"schedulingInterval": f"{self.args.interval}s"}
        enable_s = [timed_retry(lambda v=vid: A.replication.requests.enable(A.status.resolve("volume", v), interval),
                                deadline_s=600) for vid in self.vids]
        self.out["phases_s"]["create_and_enable"] = round(time.monotonic() - t, 2)
        self.out["enable_s"] = summary(enable_s)

    def writer(self) -> None:
        """A live site: a few blocks change somewhere all the time."""
        while not self.stop.is_set():
            vid = self.rnd.choice(self.vids)
            try:
                with open(self.A.pool.image(vid), "r+b") as f:
                    f.seek(self.rnd.randrange(self.args.mib * MiB // 4096) * 4096)
                    f.write(self.rnd.randbytes(4096))
            except OSError:
                pass
            self.stop.wait(0.05)

    def failovers(self, units, label, A, B) -> dict:
        demote, promote = [], []
        t = time.monotonic()
        for vid in units:
            demote.append(timed_retry(lambda v=vid: A.replication.requests.demote(
                A.status.resolve("volume", v), force=False), deadline_s=self.args.deadline))
            promote.append(timed_retry(lambda v=vid: B.replication.requests.promote(
                B.status.resolve("volume", v), force=False), deadline_s=self.args.deadline))
            assert find_state(self.sb.pool, vid).role == "primary", vid
        self.out["phases_s"][label] = round(time.monotonic() - t, 2)
        return {"demote_s": summary(demote), "promote_s": summary(promote)}

    def measure(self) -> None:
        args, out, sa, vids = self.args, self.out, self.sa, self.vids
        threading.Thread(target=self.writer, daemon=True).start()
        t = time.monotonic()
        time.sleep(args.warmup)
        out["phases_s"]["warmup"] = round(time.monotonic() - t, 2)
        synced = sum(1 for v in vids if (st := find_state(self.sb.pool, v)) is not None and st.generation >= 1)
        picks = self.rnd.sample(vids, args.failovers + args.contrast)
        s0, t0 = _syncs_total(sa.pool, vids), time.monotonic()
        out["with_control_worker"] = self.failovers(picks[:args.failovers], "failovers", self.A, self.B)
        out["syncs_per_s"] = round((_syncs_total(sa.pool, vids) - s0) / (time.monotonic() - t0), 2)
        out["schedule_delay_s"] = summary(_delays(sa.pool, vids))
        out["units_synced_before_failovers"] = synced
        if args.contrast:
            out["one_queue"] = self.failovers(picks[args.failovers:], "contrast", *self.open_sites(OneQueue))


def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="drsvc-bench-control-"))
    lab = Lab(root, pool_size="40G", visibility_timeout=600)
    out: dict = {"units": args.units, "interval_s": args.interval, "volume_mib": args.mib, "phases_s": {}}
    bench = None
    try:
        lab.build()
        lab.up()
        bench = ControlBench(args, lab, out)
        bench.create_and_enable()
        bench.measure()
    finally:
        if bench is not None:
            bench.stop.set()
        lab.teardown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=600)
    ap.add_argument("--mib", type=int, default=16, help="size of each volume")
    ap.add_argument("--interval", type=int, default=15)
    ap.add_argument("--warmup", type=float, default=30, help="seconds of scheduled syncs before measuring")
    ap.add_argument("--failovers", type=int, default=20)
    ap.add_argument("--contrast", type=int, default=3, help="failovers with control on the data queue")
    ap.add_argument("--deadline", type=float, default=600, help="give up on one call after this long")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = run(args)
    w, c = out["with_control_worker"], out.get("one_queue")
    print(f"{out['units']} units every {out['interval_s']}s; data worker {out['syncs_per_s']} syncs/s; "
          f"schedule delay p50 {out['schedule_delay_s']['p50']} s p99 {out['schedule_delay_s']['p99']} s")
    print(f"enable            p50 {out['enable_s']['p50']} s  p99 {out['enable_s']['p99']} s")
    for label, r in (("control queue", w), ("one queue (before)", c)):
        if r:
            print(f"{label:18s} demote p50 {r['demote_s']['p50']} s p99 {r['demote_s']['p99']} s | "
                  f"promote p50 {r['promote_s']['p50']} s p99 {r['promote_s']['p99']} s (n={r['demote_s']['n']})")
    print("phases (s): " + ", ".join(f"{k} {v}" for k, v in out["phases_s"].items()))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
