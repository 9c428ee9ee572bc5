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

import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from drsvc import runner

from .floor import coalesce
from .harness import MiB, RSYNC_DELTA, CaseResult, Run, measure, phase_medians, rewrite_blocks, run_rsync
from .harness import same_content, stats, write_random
from .rss import PeakRss, receiver_of


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


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
    from drsvc.replication.common import find_state
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
class ManyLab:
    """What the many and idle_celery cases run on: the lab, site a's request side, the
    volumes, and the sshd rsync uses (each reached through the link with --link)."""
    args: object
    rnd: object
    lab: object
    rsite: object
    app: object = None
    dispatcher: object = None
    vids: list = field(default_factory=list)
    img: dict = field(default_factory=dict)

    @property
    def pool(self) -> Path:
        return self.lab.sites["a"].pool

    def replica(self, vid: str) -> Path:
        return self.lab.sites["b"].pool / "images" / f"{vid}.img"

    def volumes(self):
        """--many-count volumes at a: one of random data, the others reflink clones of it;
        each enabled for replication through the request side; waits for the initial syncs."""
        from drsvc.model import BLOCK, Capability, ContentSource
        from drsvc.replication.common import find_state
        from drsvc.site import Site
        from workers.app import make_app
        from workers.client import CeleryDispatcher
        n, size = self.args.many_count, self.args.many_mib * MiB
        cfg = self.lab.sites["a"].cfg
        self.app = make_app(cfg)
        self.dispatcher = CeleryDispatcher(self.app)
        site = Site.from_config(cfg, dispatcher=self.dispatcher, rpc_wait=600)
        caps = [Capability(BLOCK, "SINGLE_NODE_WRITER")]
        base = site.volumes.create_volume("many-000", required_bytes=size, capabilities=caps)
        write_random(site.pool.image(base.volume_id), base.capacity_bytes, self.rnd)
        vols = [base] + [site.volumes.create_volume(f"many-{i:03}", required_bytes=size, capabilities=caps,
                                                    source=ContentSource("volume", base.volume_id))
                         for i in range(1, n)]
        self.vids = [v.volume_id for v in vols]
        self.img = {vid: site.pool.image(vid) for vid in self.vids}
        t = time.monotonic()
        for vid in self.vids:
            site.replication.requests.enable(site.status.resolve("volume", vid), {"schedulingInterval": "1h"})

        def initial_done():
            return all((st := find_state(self.pool, vid)) is not None and st.generation >= 1 for vid in self.vids)
        _wait(initial_done, 120 + n * (size / (50 * MiB) + 2), "the initial syncs")
        return round(time.monotonic() - t, 3)


def measure_many(m: ManyLab, res: CaseResult, cold) -> None:
    """Per run: 1% of every volume rewritten, all queued at once; rsync of each beside."""
    args, rdir = m.args, m.lab.sites["b"].pool.parent / "rsync"
    rdir.mkdir(exist_ok=True)
    for vid in m.vids:
        runner.run(["cp", "--reflink=always", m.replica(vid), rdir / f"{vid}.img"])

    def change(i):
        files = [(m.img[vid], coalesce(rewrite_blocks(m.img[vid], 0.01, m.rnd))) for vid in m.vids]
        return Run(sum(ln for _, ranges in files for _, ln in ranges), files)
    durations = []

    def drsvc(i):
        out = _sync_all(m.app, m.dispatcher, m.vids, m.pool, timeout=600 + len(m.vids) * 30)
        durations.extend(out["durations"])
        return out

    def rsync(i):
        t = time.monotonic()
        wire = sum(run_rsync(m.rsite, m.img[vid], rdir / f"{vid}.img", RSYNC_DELTA)[1] for vid in m.vids)
        return time.monotonic() - t, wire
    measure(res, args.repeat, make_cold=cold, change=change, drsvc=drsvc, rsync=None if args.no_rsync else rsync)
    n = len(m.vids)
    res.extra.update({
        "units": n, "volume_bytes": args.many_mib * MiB, "worker_concurrency": 1,
        "syncs_per_s": stats([n / w for w in res.drsvc]),
        "rsync_runs_per_s": stats([n / w for w in res.rsync]) if res.rsync else None,
        "per_sync_worker_s": {"median": round(statistics.median(durations), 4),
                              "max": round(max(durations), 4), "syncs": len(durations)}})
    res.verified = all(same_content(m.img[vid], m.replica(vid), *([] if args.no_rsync else [rdir / f"{vid}.img"]))
                       for vid in m.vids)


def measure_idle(m: ManyLab, idle: CaseResult) -> None:
    """idle_celery: a few KiB changed, one sync at a time, in the warm worker."""
    from drsvc.replication.common import find_state
    vid = m.vids[0]
    blocks = max(1, m.args.idle_kib // 4)
    jobs_s = []

    def one(i):
        t = time.monotonic()
        out = m.app.AsyncResult(m.dispatcher.submit("sync", vid, {"trigger": "bench"})).get(
            timeout=600, disable_sync_subtasks=False)
        wall = time.monotonic() - t
        if not out.get("ok"):
            raise RuntimeError(f"idle sync failed: {out}")
        jobs_s.append(out["duration_s"])
        return {"wall_s": wall, "report": {"bytes_on_wire": out["bytes_on_wire"],
                                           "phases": find_state(m.pool, vid).reports[-1].get("phases", {})}}
    measure(idle, max(m.args.idle_syncs, 1), make_cold=lambda: None,
            change=lambda i: Run(len(rewrite_blocks(m.img[vid], 0, m.rnd, count=blocks)) * 4096),
            drsvc=one, rsync=None)
    idle.extra.update({"worker_job_s": stats(jobs_s), "image_bytes": m.args.many_mib * MiB, "goal_s": 0.030,
                       "note": "drsvc_s: enqueue to result through Celery; worker_job_s: the job itself"})
    idle.verified = same_content(m.img[vid], m.replica(vid))


@contextlib.contextmanager
def reached(args, lab, rsite):
    """With --link: site a's peer b and rsync's sshd, each behind a route of one emulator."""
    if args.link is None:
        yield rsite
        return
    from .wan import LinkProcess, route_lab_peer, through
    sb = lab.sites["b"]
    with LinkProcess(args.link, [sb.sshd_port, rsite.port]) as link:
        route_lab_peer(lab.sites["a"], "b", sb.sshd_port, link.ports[0], link_rate=args.link.rate)
        yield through(rsite, link.ports[1])


def many_case(args, rnd) -> list[CaseResult]:
    from drsvc_lab import Lab

    from .site import Cold, sshd_site
    n, size = args.many_count, args.many_mib * MiB
    res = CaseResult("many", not args.warm)
    idle = CaseResult("idle_celery", False)
    root = Path(tempfile.mkdtemp(prefix="drsvc-bench-many-"))
    lab = Lab(root, pool_size=f"{max(20, 2 * n * size // (1 << 30) + 8)}G", visibility_timeout=600)
    try:
        lab.build()
        sa, sb = lab.sites["a"], lab.sites["b"]
        cold = Cold([sa.pool.parent, sb.pool.parent], [sa.fs_image, sb.fs_image],
                    "off" if args.warm else args.drop_caches)
        with sshd_site(sb.pool) as plain, reached(args, lab, plain) as rsite, \
                OneWorker(sa.cfg, root / "worker.log") as worker, \
                PeakRss(worker.matches) as srss, PeakRss(receiver_of(sb.pool)) as rrss:
            m = ManyLab(args, rnd, lab, rsite)
            res.extra["initial_syncs_s"] = m.volumes()
            measure_many(m, res, cold)
            measure_idle(m, idle)
        res.rss = idle.rss = {"sender": srss.peak, "receiver": rrss.peak}
    finally:
        lab.teardown()
    return [res, idle]
