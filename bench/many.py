"""Cases `many` and `idle_celery`: syncs through the real Celery path, by ONE worker process.

A two-site lab of its own (drsvc_lab: pools on loop XFS, redis-server, sshd
with the forced receiver and pinned host keys, site configs) and one Celery
worker (`drsvc worker --concurrency 1`, the argv `drsvc site up` uses). Volumes
are made by the site's volume service: one of --many-mib MiB filled with random
data, the others reflink clones of it (CreateVolume from a volume source); each
is enabled for replication through the request side (the worker runs the enable
job and the initial sync). Then, per run, 1% of every volume is rewritten and
all of them are queued at once as drsvc.sync tasks by the Celery dispatcher, as
the scheduler's enqueue does: `drsvc_s` is the wall time from the first enqueue
to the last result, beside --many-count rsync runs of the same data (rsync's
copies are reflink copies of the replicas after the initial sync).

`idle_celery`: then --idle-syncs syncs of one volume with --idle-kib KiB changed,
each queued and awaited alone: wall time from enqueue to result (what a caller
sees), and the worker's own duration of the sync job.
"""
from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from drsvc import runner
from drsvc.model import BLOCK, Capability, ContentSource
from drsvc.replication.state import find_state
from drsvc.site import Site
from drsvc_lab import Lab, wait_until
from workers.app import make_app
from workers.client import CeleryDispatcher

from .floor import coalesce
from .harness import MiB, RSYNC_DELTA, CaseResult, Run, measure, phase_medians, rewrite_blocks, run_rsync
from .harness import same_content, stats, write_random
from .rss import PeakRss, receiver_of
from .site import Cold, sshd_site


class OneWorker:
    """One Celery worker process for a site, concurrency 1 (a context manager)."""

    def __init__(self, cfg, log: Path):
        self.cfg, self.log = cfg, log
        self.proc = None

    def __enter__(self):
        argv = [sys.executable, "-c", "import sys; from workers.main import worker_main; sys.exit(worker_main())",
                "--config", self.cfg.path, "--hostname", f"bench-{self.cfg.site}@%h", "--concurrency", "1",
                "--loglevel", "WARNING"]
        env = dict(os.environ, DRSVC_CONFIG=str(self.cfg.path), PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = runner.spawn(argv, env=env, stdout=log, stderr=log)
        return self

    def matches(self, cmd: bytes) -> bool:
        """The worker and its pool process (a fork: same command line)."""
        return b"worker_main" in cmd and str(self.cfg.path).encode() in cmd

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except Exception:  # noqa: BLE001 - it must not outlive the bench
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _sync_all(app, dispatcher, vids, pool, timeout: float) -> dict:
    """Queue one drsvc.sync per volume at once; wait for every result."""
    t = time.monotonic()
    ids = [dispatcher.submit("sync", vid, {"trigger": "bench"}) for vid in vids]
    results = [app.AsyncResult(i).get(timeout=timeout, disable_sync_subtasks=False) for i in ids]
    wall = time.monotonic() - t
    bad = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(vids)} syncs failed: {bad[0]}")
    phases = [find_state(pool, vid).reports[-1].get("phases", {}) for vid in vids]
    return {"wall_s": wall, "durations": [r["duration_s"] for r in results],
            "report": {"bytes_on_wire": sum(r["bytes_on_wire"] for r in results),
                       "phases": phase_medians(phases)}}


@dataclass
class Many:
    """The many case on its lab: site a's Celery app and services, and the volumes."""
    args: object
    rnd: object
    lab: Lab
    app: object = None
    dispatcher: object = None
    site: object = None
    vids: list = field(default_factory=list)
    img: dict = field(default_factory=dict)

    def __post_init__(self):
        self.sa, self.sb = self.lab.sites["a"], self.lab.sites["b"]
        cfg = self.sa.cfg
        self.app = make_app(cfg)
        self.dispatcher = CeleryDispatcher(self.app)
        self.site = Site.from_config(cfg, dispatcher=self.dispatcher, rpc_wait=600)

    def make_volumes(self, n: int, size: int) -> None:
        """One volume of random data, and n - 1 reflink clones of it (CreateVolume from a volume)."""
        caps = [Capability(BLOCK, "SINGLE_NODE_WRITER")]
        volumes = self.site.volumes
        base = volumes.create_volume("many-000", required_bytes=size, capabilities=caps)
        write_random(self.site.pool.image(base.volume_id), base.capacity_bytes, self.rnd)
        vols = [base] + [volumes.create_volume(f"many-{i:03}", required_bytes=size, capabilities=caps,
                                               source=ContentSource("volume", base.volume_id))
                         for i in range(1, n)]
        self.vids = [v.volume_id for v in vols]
        self.img = {vid: self.site.pool.image(vid) for vid in self.vids}

    def initial_syncs(self, n: int, size: int) -> float:
        """Enable every volume (the worker runs the enable job and the initial sync); seconds."""
        t = time.monotonic()
        for vid in self.vids:
            self.site.replication.requests.enable(self.site.status.resolve("volume", vid),
                                                  {"schedulingInterval": "1h"})
        wait_until(lambda: all((st := find_state(self.sa.pool, vid)) is not None and st.generation >= 1
                               for vid in self.vids),
                   120 + n * (size / (50 * MiB) + 2), "the initial syncs", interval=0.2)
        return round(time.monotonic() - t, 3)

    def measure_many(self, res: CaseResult, cold, rsite, rdir: Path) -> None:
        """Per run: 1% of every volume rewritten, then all queued at once, beside rsync."""
        args, n, img = self.args, len(self.vids), self.img
        durations = []

        def change(i):
            files = [(img[vid], coalesce(rewrite_blocks(img[vid], 0.01, self.rnd))) for vid in self.vids]
            return Run(sum(ln for _, ranges in files for _, ln in ranges), files)

        def drsvc(i):
            out = _sync_all(self.app, self.dispatcher, self.vids, self.sa.pool, timeout=600 + n * 30)
            durations.extend(out["durations"])
            return out

        def rsync(i):
            t = time.monotonic()
            wire = sum(run_rsync(rsite, img[vid], rdir / f"{vid}.img", RSYNC_DELTA)[1] for vid in self.vids)
            return time.monotonic() - t, wire
        measure(res, args.repeat, make_cold=cold, change=change, drsvc=drsvc,
                rsync=None if args.no_rsync else rsync)
        res.extra.update({
            "units": n, "volume_bytes": args.many_mib * MiB, "worker_concurrency": 1,
            "syncs_per_s": stats([n / w for w in res.drsvc]),
            "rsync_runs_per_s": stats([n / w for w in res.rsync]) if res.rsync else None,
            "per_sync_worker_s": {"median": round(statistics.median(durations), 4),
                                  "max": round(max(durations), 4), "syncs": len(durations)}})
        res.verified = all(same_content(img[vid], self.sb.pool / "images" / f"{vid}.img",
                                        *([] if args.no_rsync else [rdir / f"{vid}.img"])) for vid in self.vids)

    def measure_idle(self, idle: CaseResult) -> None:
        """idle_celery: a few KiB changed, one sync at a time, in the warm worker."""
        vid = self.vids[0]
        blocks = max(1, self.args.idle_kib // 4)
        jobs_s = []

        def one(i):
            t = time.monotonic()
            out = self.app.AsyncResult(self.dispatcher.submit("sync", vid, {"trigger": "bench"})).get(
                timeout=600, disable_sync_subtasks=False)
            wall = time.monotonic() - t
            if not out.get("ok"):
                raise RuntimeError(f"idle sync failed: {out}")
            jobs_s.append(out["duration_s"])
            return {"wall_s": wall, "report": {"bytes_on_wire": out["bytes_on_wire"],
                                               "phases": find_state(self.sa.pool, vid).reports[-1].get("phases", {})}}
        measure(idle, max(self.args.idle_syncs, 1), make_cold=lambda: None,
                change=lambda i: Run(len(rewrite_blocks(self.img[vid], 0, self.rnd, count=blocks)) * 4096),
                drsvc=one, rsync=None)
        idle.extra.update({"worker_job_s": stats(jobs_s), "image_bytes": self.args.many_mib * MiB, "goal_s": 0.030,
                           "note": "drsvc_s: enqueue to result through Celery; worker_job_s: the job itself"})
        idle.verified = same_content(self.img[vid], self.sb.pool / "images" / f"{vid}.img")


def many_case(args, rnd) -> list[CaseResult]:
    n, size = args.many_count, args.many_mib * MiB
    cold_ok = not args.warm
    res = CaseResult("many", cold_ok)
    idle = CaseResult("idle_celery", False)
    root = Path(tempfile.mkdtemp(prefix="drsvc-bench-many-"))
    lab = Lab(root, pool_size=f"{max(20, 2 * n * size // (1 << 30) + 8)}G", visibility_timeout=600)
    try:
        lab.build()
        m = Many(args, rnd, lab)
        sa, sb = m.sa, m.sb
        cold = Cold([sa.pool.parent, sb.pool.parent], [sa.fs_image, sb.fs_image],
                    args.drop_caches if cold_ok else "off")
        rdir = sb.pool.parent / "rsync"
        rdir.mkdir()
        m.make_volumes(n, size)
        with OneWorker(sa.cfg, root / "worker.log") as worker, \
                PeakRss(worker.matches) as srss, PeakRss(receiver_of(sb.pool)) as rrss, \
                sshd_site(sb.pool) as rsite:
            res.extra["initial_syncs_s"] = m.initial_syncs(n, size)
            for vid in m.vids:
                runner.run(["cp", "--reflink=always", sb.pool / "images" / f"{vid}.img", rdir / f"{vid}.img"])
            m.measure_many(res, cold, rsite, rdir)
            m.measure_idle(idle)
        res.rss = idle.rss = {"sender": srss.peak, "receiver": rrss.peak}
    finally:
        lab.teardown()
    return [res, idle]
