"""A replicated pair of multi-node sites at scale: `python -m bench.scale --json`.

    python -m bench.scale [--volumes 600] [--mib 64] [--interval 60] [--warmup 90]
                          [--duration 300] [--growth 600,2000,5000] [--faults] [--json]

Two sites of three storage nodes (drsvc_lab.NodesLab: per node a loop XFS pool, an sshd
on 127.0.<site>.<node>, a data worker, an api worker, a scheduler; per site a Redis and
the controller). --volumes volumes of --mib MiB are created through site a's controller
(CreateVolume over the unix socket, placed on the nodes by the controller, each create a
task on the chosen node; p50/p99 are recorded), 1% of each is written, and each is
enabled (EnableVolumeReplication, schedulingInterval --interval). A writer then rewrites
1% of every volume once per interval, one volume after another, spread over the interval.

After --warmup seconds, a window of --duration seconds is measured:
- scheduling drift (a scheduled sync's start minus the slot it was due at), p50/p99, from
  the data workers' task results (scheduling_delay_s) over the window;
- lag (drsvc.replication.control.read_model describe: seconds since the last successful sync ended),
  sampled over all units every few seconds: p50/p99/max, and how many units stayed HEALTHY
  with lag <= 1.5x the interval in every sample;
- syncs per second (sync reports at site a that started in the window), time per sync
  and the per-phase medians the reports carry;
- Redis commands per sync (INFO commandstats calls at site a's Redis, delta / syncs);
- CPU seconds (utime+stime of each process tree, reaped children included) and peak RSS
  (sum over a type's processes, sampled, and the largest single VmHWM) per process type.

After each window, with the syncs going on: Redis memory per unit (used_memory over the
one at lab start), `drsvc status` of every unit (the Admin service's ListReplications, page
by page, over each node's pool), a /metrics scrape of each node (workers.metrics'
Exporter), each twice, --listing-gap (15 s) apart (the first pass parses every unit's records, the next
only those that changed), and --creates-under-load CreateVolume calls timed.

--growth 600,2000,5000 measures a window at each size on one lab (volumes are added between
windows), and prints one table row per size, to show which figures grow with the units.

--site-failover (last): site a is lost while its units replicate (every process of it,
its Redis included, killed -9), and site b's controller takes forced PromoteVolume calls for
every unit, --promote-parallel at a time (each retried while ABORTED), as the csi-addons
controller sends them; with --promote-all, one PromoteAll at b's controller instead, as
`drsvc promote --all --force` sends it (each node takes its units as one batch). It reports
the takeover's wall time, one promote's p50/p99, the units primary at b afterwards, any
promoted twice (an epoch moved by more than one) or not at all, and --verify replicas checksummed against a's image of the generation
b holds: the one a had acked, or the one past it that b committed before a heard (a
replica behind a's ack is counted as a loss).

--faults then runs, one at a time on the running lab: kill -9 of one node's worker (and
restart), one node's sshd stopped at the peer, a restart (SIGKILL) of site a's Redis, kill
-9 of the controller. For each: which units degraded (not HEALTHY or lag > 1.5x interval),
for how long, failed syncs, and after recovery, with the writer paused, a fresh sync of a
sample of the affected units and sha256 of source against replica image.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

MiB = 1 << 20
NODE = "topology.drsvc.io/node"
TYPES = ("worker", "api", "scheduler", "controller", "redis", "sshd+receivers")
DELAY_RE = re.compile(rb"Task drsvc\.sync[ \[][^\]\n]*\] succeeded in [0-9.e-]+s: .*'scheduling_delay_s': ([0-9.e-]+)")
CLK = os.sysconf("SC_CLK_TCK")


def pct(xs, p):
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))], 4)


def summary(xs) -> dict:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "max": round(max(xs), 4) if xs else None}


def summary_ms(xs) -> dict:
    """summary() of seconds, in milliseconds."""
    return {k: (round(v * 1000, 1) if isinstance(v, float) else v) for k, v in summary(xs).items()}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- /proc ---------------------------------------------------------------------------
def proc_table() -> dict:
    """pid -> (ppid, cpu ticks incl. reaped children, rss kB, hwm kB)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
            rss = hwm = 0
            with open(f"/proc/{d}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmRSS:"):
                        rss = int(line.split()[1])
                    elif line.startswith(b"VmHWM:"):
                        hwm = int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out[int(d)] = (int(rest[1]), sum(int(x) for x in rest[11:15]), rss, hwm)
    return out


def tree_of(table: dict, root: int) -> list[int]:
    kids: dict[int, list] = {}
    for pid, row in table.items():
        kids.setdefault(row[0], []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        if p in table:
            out.append(p)
            todo.extend(kids.get(p, ()))
    return out


def roots(lab, sites=None) -> dict:
    """type -> [root pids] over both sites (or *sites*)."""
    r: dict[str, list] = {t: [] for t in TYPES}
    for site in sites or lab.sites:
        run = lab.run_of(site)
        for n in lab.nodes:
            for what in ("worker", "api", "scheduler"):
                if (pid := run.pid(f"{what}@{n}")) is not None:
                    r[what].append(pid)
        if (pid := run.pid("controller")) is not None:
            r["controller"].append(pid)
        if site in lab.redis_procs:
            r["redis"].append(lab.redis_procs[site].pid)
        for n in lab.nodes:
            if (p := lab.sshd_procs.get((site, n))) is not None:
                r["sshd+receivers"].append(p.pid)
    return r


def usage(lab, sites=None) -> dict:
    """type -> {cpu_ticks, rss_kb, hwm_kb (largest single process), procs}."""
    table = proc_table()
    out = {}
    for t, pids in roots(lab, sites).items():
        members = [p for root in pids for p in tree_of(table, root)]
        out[t] = {"cpu": sum(table[p][1] for p in members), "rss_kb": sum(table[p][2] for p in members),
                  "hwm_kb": max((table[p][3] for p in members), default=0), "procs": len(members)}
    return out


# -- Redis ---------------------------------------------------------------------------
def redis_calls(port: int) -> int:
    import redis
    stats = redis.Redis(port=port, socket_timeout=10).info("commandstats")
    return sum(v["calls"] for v in stats.values())


def redis_memory(port: int) -> dict:
    import redis
    r = redis.Redis(port=port, socket_timeout=10)
    return {"used": r.info("memory")["used_memory"], "keys": r.dbsize()}


# -- the operator's listings, through their real code over every node's pool --------------
GAP_S = 15.0       # default --listing-gap: between a listing's first pass and its next (a scrape interval)


def status_all(lab, site: str, page: int, gap: float = GAP_S) -> dict:
    """`drsvc status` of every unit: the Admin service's ListReplications (the code the CLI
    calls), page after page, over each storage node's pool; wall time and pages. Twice, as
    the plugin answers them: the first walk of a new read model parses every unit's records
    (``first_s``), the next, *gap* seconds later, only those that changed (``s``)."""
    from csi_plugin.admin_servicer import Admin
    from drsvc.replication.control import ReplicationStatus
    admins = [Admin(None, None, ReplicationStatus(site, lab.pool(n, site), None, None)) for n in lab.nodes]
    first = _walk(admins, page)
    time.sleep(gap)
    return {**_walk(admins, page), "first_s": first["s"]}


def _walk(admins, page: int) -> dict:
    from csi_plugin.gen import admin_pb2
    t, pages, rows, worst = time.perf_counter(), 0, 0, 0.0
    for admin in admins:
        token = ""
        while True:
            t0 = time.perf_counter()
            out = admin.ListReplications(admin_pb2.ListReplicationsRequest(max_entries=page, starting_token=token),
                                         None)
            worst = max(worst, time.perf_counter() - t0)
            pages, rows, token = pages + 1, rows + len(out.replications), out.next_token
            if not token:
                break
    return {"s": round(time.perf_counter() - t, 3), "rows": rows, "pages": pages, "slowest_page_s": round(worst, 3)}


def scrape_all(lab, site: str, gap: float = GAP_S) -> dict:
    """A /metrics scrape of each storage node (workers.metrics' Exporter: the page its HTTP
    server answers): the slowest node's time and the bytes of all. Twice, as a running
    exporter answers them: the first scrape of a new exporter parses every record
    (``first_s``), the next, *gap* seconds later, only those that changed (``s``)."""
    from drsvc.config import load
    from workers.metrics import Exporter
    exporters = [Exporter(load(lab.config_of(site), node=n)) for n in lab.nodes]

    def scrape() -> tuple[float, int]:
        worst, size = 0.0, 0
        for ex in exporters:
            t = time.perf_counter()
            size += len(ex.page())
            worst = max(worst, time.perf_counter() - t)
        return worst, size
    first, _ = scrape()
    time.sleep(gap)
    worst, size = scrape()
    return {"s": round(worst, 3), "first_s": round(first, 3), "bytes": size}


# -- the bench -------------------------------------------------------------------------
class Scale:
    def __init__(self, args):
        from drsvc_lab import NodesLab
        self.args = args
        self.rnd = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix="drsvc-bench-scale-"))
        self.lab = NodesLab(self.root, sites=("a", "b"), nodes=("n1", "n2", "n3"), pool_size=args.pool_size,
                            visibility_timeout=max(60, 2 * args.interval), node_call_timeout=30)
        self.vols: dict[str, str] = {}        # volume id -> node
        self.moved: dict[str, str] = {}       # failed over to site b by --failovers
        self.create_s: list[float] = []
        self.enable_s: list[float] = []
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.out: dict = {"args": vars(args), "stages": [], "faults": []}

    # -- calls -------------------------------------------------------------------------
    def connect(self):
        from csi_plugin.gen import csi_pb2_grpc, replication_pb2_grpc
        self.channel = grpc.insecure_channel(self.lab.endpoint_of("a"))
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.ctl = csi_pb2_grpc.ControllerStub(self.channel)
        self.repl = replication_pb2_grpc.ControllerStub(self.channel)
        self.channel_b = grpc.insecure_channel(self.lab.endpoint_of("b"))
        grpc.channel_ready_future(self.channel_b).result(timeout=60)
        self.repl_b = replication_pb2_grpc.ControllerStub(self.channel_b)

    def create(self, name: str) -> tuple[str, str]:
        from csi_plugin.gen import csi_pb2
        cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                                       access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
        req = csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(
            required_bytes=self.args.mib * MiB), volume_capabilities=[cap])
        vol = self.ctl.CreateVolume(req, timeout=60).volume
        return vol.volume_id, dict(vol.accessible_topology[0].segments)[NODE]

    def enable(self, vid: str) -> None:
        from csi_plugin.gen import replication_pb2
        req = replication_pb2.EnableVolumeReplicationRequest(
            parameters={"schedulingInterval": f"{self.args.interval}s"})
        req.replication_source.volume.volume_id = vid
        for _ in range(600):
            try:
                self.repl.EnableVolumeReplication(req, timeout=60)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED:
                    raise
                time.sleep(0.2)
        raise RuntimeError(f"enable of {vid} still ABORTED")

    @staticmethod
    def retried(call, req) -> float:
        """Wall time of *call* as the csi-addons controller sees it: ABORTED (a sync holds
        the unit) is retried after 0.2 s."""
        t = time.perf_counter()
        while True:
            try:
                call(req, timeout=120)
                return time.perf_counter() - t
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED or time.perf_counter() - t > 600:
                    raise
                time.sleep(0.2)

    def failovers(self, count: int) -> dict:
        """Planned failovers of *count* units while the rest keep syncing: DemoteVolume at
        site a's controller (its final sync included), then PromoteVolume at site b's, each
        timed through gRPC. The units then belong to site b and leave the measured set."""
        from csi_plugin.gen import replication_pb2
        demote, promote = [], []
        load0 = os.getloadavg()
        for vid in self.rnd.sample(sorted(self.vols), min(count, len(self.vols))):
            self.moved[vid] = self.vols.pop(vid)     # the writer leaves it alone from now on
            time.sleep(0.5)                          # (a write in progress ends)
            d = replication_pb2.DemoteVolumeRequest()
            d.replication_source.volume.volume_id = vid
            demote.append(self.retried(self.repl.DemoteVolume, d))
            p = replication_pb2.PromoteVolumeRequest()
            p.replication_source.volume.volume_id = vid
            promote.append(self.retried(self.repl_b.PromoteVolume, p))
        out = {"failovers": len(promote), "units_syncing": len(self.vols),
               "load_avg_before": [round(x, 2) for x in load0],
               "demote_ms": summary_ms(demote), "promote_ms": summary_ms(promote)}
        log(f"failovers: {json.dumps(out)}")
        return out

    def promote_all_at_b(self) -> list[tuple]:
        """One PromoteAll (force) at b's controller, as `drsvc promote --all --force` sends it:
        (seconds, "") per unit promoted, (None, "CODE: message") per unit that failed."""
        from csi_plugin.gen import admin_pb2, admin_pb2_grpc
        out = admin_pb2_grpc.SiteStub(self.channel_b).PromoteAll(admin_pb2.PromoteAllRequest(force=True),
                                                                 timeout=3600)
        return [(u.seconds, "") if u.result == "promoted" else (None, f"{u.code}: {u.message}") for u in out.units]

    def _checksum_sample(self, units: list, sample: int) -> dict:
        """A sample of b's promoted replicas against a's image of the generation b holds. b
        may hold one generation more than a recorded as acked (a was killed between b's
        commit and its ack): that one is a's pending snapshot. b behind a's ack is a loss."""
        from drsvc.layout import PoolLayout
        from drsvc.replication.common import find_state
        from drsvc.replication.sender import generation_image
        out = {"same_as_a": 0, "differ": 0, "unchecked": 0, "ahead_of_acked": 0, "behind_acked": 0}
        for v in self.rnd.sample(units, min(sample, len(units))):
            st_a, st_b = find_state(self.lab.pool(self.vols[v], "a"), v), find_state(self.lab.pool(self.vols[v], "b"), v)
            acked, held = (st_a.generation if st_a else 0), (st_b.generation if st_b else 0)
            out["ahead_of_acked"] += held > acked
            out["behind_acked"] += held < acked
            lay = PoolLayout(self.lab.pool(self.vols[v], "a"))
            if not held or not (lay.snap_dir(v, held) / "meta.json").exists():
                out["unchecked"] += 1
                continue
            with tempfile.TemporaryDirectory(dir=lay.unit_dir(v)) as scratch:
                same = sha(generation_image(lay, v, held, v, Path(scratch))) == sha(self.image(v, "b"))
            out["same_as_a" if same else "differ"] += 1
        return out

    def site_failover(self, sample: int, parallel: int) -> dict:
        """Site a lost while its units replicate, then every unit promoted at b with force:
        *parallel* PromoteVolume calls at a time at b's controller, each retried while it
        answers ABORTED, as the csi-addons controller reconciles VolumeReplications; or with
        --promote-all one PromoteAll there, as `drsvc promote --all --force` sends it."""
        from concurrent.futures import ThreadPoolExecutor
        from csi_plugin.gen import replication_pb2
        from drsvc.replication.common import find_state
        from drsvc_lab.nodes import node_components
        units = sorted(self.vols)
        before = {v: find_state(self.lab.pool(self.vols[v], "b"), v) for v in units}
        run = self.lab.run_of("a")
        t_lost = time.time()
        for c in reversed(node_components(run.cfg)):
            run.stop(c, sig=signal.SIGKILL)
        self.lab.stop_redis("a")
        self.stop.set()                      # the writer's images are a's: they are gone with it
        log(f"site a lost (killed in {time.time() - t_lost:.1f}s); {len(units)} forced promotes at b")

        def promote(vid: str):
            req = replication_pb2.PromoteVolumeRequest(force=True)
            req.replication_source.volume.volume_id = vid
            try:
                return self.retried(self.repl_b.PromoteVolume, req), ""
            except grpc.RpcError as e:
                return None, f"{e.code().name}: {e.details()}"
        t = time.perf_counter()
        if self.args.promote_all:
            done = self.promote_all_at_b()
        else:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                done = list(pool.map(promote, units))
        wall = time.perf_counter() - t
        times = [s for s, _ in done if s is not None]
        errors = [err for s, err in done if s is None]
        primary = twice = missed = 0
        for v in units:
            st = find_state(self.lab.pool(self.vols[v], "b"), v)
            if st is None or st.role != "primary":
                missed += 1
                continue
            primary += 1
            twice += st.epoch != (before[v].epoch if before[v] else 0) + 1
        checked = self._checksum_sample(units, sample)
        out = {"units": len(units), "parallel": "PromoteAll" if self.args.promote_all else parallel,
               "takeover_s": round(wall, 2),
               "promote_ms": summary_ms(times), "promoted": len(times), "failed": len(errors),
               "errors_first": errors[:3], "primary_at_b": primary, "not_primary": missed, "promoted_twice": twice,
               "checksummed": checked, "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
        log(f"site failover: {json.dumps(out)}")
        return out

    def failback(self, sample: int, parallel: int) -> dict:
        """Site a returns after the site failover (its Redis and processes start again), and
        every unit comes home as Ramen's failback drives it at a's controller, every unit's
        VolumeReplication reconciled at once: DemoteVolume (force) and ResyncVolume (force),
        then ResyncVolume again until it answers ready, *parallel* calls in flight. b's next
        sync of each, a compare sync the resync asks b for now, ships only what diverged (the
        writes a took after its last sync to b). Reported: the wall time until every unit is
        ready at a (at hundreds of units, bounded by b's compare syncs, each of which reads the
        whole of both copies to find what differs), one unit's p50/p99, b's bytes on
        the wire against the units' size, and a sample of a's copies against b's. With
        --promote-all, one DemoteAll (resync) at a's controller instead of the DemoteVolume
        and first ResyncVolume calls, as `drsvc demote --all --resync` sends it (its own time:
        ``demote_all_s``); then ResyncVolume until ready, as before."""
        from concurrent.futures import ThreadPoolExecutor
        from csi_plugin.gen import replication_pb2_grpc
        units = sorted(self.vols)
        sent0 = sum(self.describe(v, "b").sent_bytes_total for v in units)
        t = time.perf_counter()
        self.lab.start_redis("a")
        self.lab.up("a")
        up_s = time.perf_counter() - t
        channel = grpc.insecure_channel(self.lab.endpoint_of("a"))
        grpc.channel_ready_future(channel).result(timeout=60)
        repl = replication_pb2_grpc.ControllerStub(channel)
        t, deadline = time.perf_counter(), 3 * self.args.interval + 120
        started, ready, errors, demote_all_s = {}, {}, {}, None
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            if self.args.promote_all:       # one DemoteAll (resync) at a's controller, then each unit polled
                failed, demote_all_s = self._demote_all_at_a(channel, started)
                errors.update(failed)
            else:
                for vid, err in zip(units, pool.map(lambda v: self._send_home(repl, v, started), units), strict=True):
                    if err:
                        errors[vid] = err
            waiting = [v for v in units if v not in errors]
            while waiting and time.perf_counter() - t < deadline:
                for vid, (ok, err) in zip(waiting, pool.map(lambda v: self._resync(repl, v), waiting), strict=True):
                    if ok:
                        ready[vid] = time.perf_counter() - started[vid]
                    elif err:
                        errors[vid] = err
                waiting = [v for v in waiting if v not in ready and v not in errors]
                time.sleep(1.0)
        wall = time.perf_counter() - t
        channel.close()
        errors.update({v: f"{v}: not ready after {deadline:.0f}s" for v in units if v not in ready and v not in errors})
        sent = sum(self.describe(v, "b").sent_bytes_total for v in units) - sent0
        same = sum(sha(self.image(v, "a")) == sha(self.image(v, "b"))
                   for v in self.rnd.sample(units, min(sample, len(units))))
        out = {"units": len(units), "parallel": "DemoteAll" if self.args.promote_all else parallel,
               "demote_all_s": demote_all_s, "site_up_s": round(up_s, 2), "failback_s": round(wall, 2),
               "unit_ms": summary_ms(list(ready.values())), "ready": len(ready), "failed": len(errors),
               "errors_first": list(errors.values())[:3], "bytes_on_wire": sent,
               "bytes_of_units": len(units) * (self.args.mib << 20),
               "checksummed": {"same": same, "of": min(sample, len(units))},
               "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
        log(f"failback: {json.dumps(out)}")
        return out

    def _demote_all_at_a(self, channel, started: dict) -> tuple[dict, float]:
        """One DemoteAll (resync) at a's controller, as `drsvc demote --all --resync` sends it:
        ({unit: what failed} of its rows, the call's seconds); each unit's start is the call's."""
        from csi_plugin.gen import admin_pb2, admin_pb2_grpc
        t0 = time.perf_counter()
        started.update(dict.fromkeys(self.vols, t0))
        out = admin_pb2_grpc.SiteStub(channel).DemoteAll(admin_pb2.DemoteAllRequest(resync=True),
                                                         timeout=24 * 3600.0)
        seconds = round(time.perf_counter() - t0, 2)
        return {u.unit_id: f"{u.unit_id}: {u.code}: {u.message}" for u in out.units
                if u.result == "failed" or u.resync == "failed"}, seconds

    def _send_home(self, repl, vid: str, started: dict) -> str:
        """DemoteVolume (force), then the first ResyncVolume (force): "" or what failed."""
        from csi_plugin.gen import replication_pb2
        started[vid] = time.perf_counter()
        d = replication_pb2.DemoteVolumeRequest(force=True)
        d.replication_source.volume.volume_id = vid
        try:
            self.retried(repl.DemoteVolume, d)
        except grpc.RpcError as e:
            return f"{vid}: {e.code().name}: {e.details()}"
        return self._resync(repl, vid)[1]

    @staticmethod
    def _resync(repl, vid: str) -> tuple[bool, str]:
        """One ResyncVolume (force): (ready, "" or what failed); ABORTED is not ready yet."""
        from csi_plugin.gen import replication_pb2
        r = replication_pb2.ResyncVolumeRequest(force=True)
        r.replication_source.volume.volume_id = vid
        try:
            return repl.ResyncVolume(r, timeout=120).ready, ""
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                return False, ""
            return False, f"{vid}: {e.code().name}: {e.details()}"

    def image(self, vid: str, site: str = "a") -> Path:
        return self.lab.pool(self.vols[vid], site) / "images" / f"{vid}.img"

    def write(self, vid: str) -> None:
        """1% of the volume, in 64 KiB writes at random places."""
        size, chunk = self.args.mib * MiB, 64 << 10
        with open(self.image(vid), "r+b") as f:
            for _ in range(max(1, size // 100 // chunk)):
                f.seek(self.rnd.randrange(0, size - chunk, 4096))
                f.write(self.rnd.randbytes(chunk))
            f.flush()
            os.fsync(f.fileno())

    def writer(self) -> None:
        """Each volume rewritten once per interval, the volumes one after another."""
        while not self.stop.is_set():
            vids = list(self.vols)
            self.rnd.shuffle(vids)
            gap = self.args.interval / max(1, len(vids))
            t = time.monotonic()
            for i, vid in enumerate(vids):
                if self.stop.is_set():
                    return
                while self.paused.is_set() and not self.stop.is_set():
                    time.sleep(0.2)
                if vid not in self.vols:
                    continue
                try:
                    self.write(vid)
                except (OSError, KeyError):      # KeyError: failed over meanwhile
                    pass
                ahead = t + (i + 1) * gap - time.monotonic()
                if ahead > 0:
                    self.stop.wait(ahead)

    # -- reading the units' state ------------------------------------------------------
    def describe(self, vid: str, site: str = "a"):
        from drsvc.replication.control import ReplicationStatus
        return ReplicationStatus(site, self.lab.pool(self.vols[vid], site), None, None).describe(vid)

    def reports(self, vid: str) -> list[dict]:
        from drsvc.replication.common import find_state
        st = find_state(self.lab.pool(self.vols[vid], "a"), vid)
        return list(st.reports) if st else []

    def healthy(self, info) -> bool:
        return info.status == "HEALTHY" and info.lag_seconds <= 1.5 * self.args.interval

    def add(self, count: int) -> None:
        t = time.monotonic()
        base = len(self.vols)
        new = []
        for i in range(base, base + count):
            t0 = time.perf_counter()
            vid, node = self.create(f"scale-{i:05}")
            self.create_s.append(time.perf_counter() - t0)
            self.vols[vid] = node
            new.append(vid)
            self.write(vid)
        log(f"created {count} volumes in {time.monotonic() - t:.1f}s")
        t = time.monotonic()
        for vid in new:
            t0 = time.perf_counter()
            self.enable(vid)
            self.enable_s.append(time.perf_counter() - t0)
        log(f"enabled {count} volumes in {time.monotonic() - t:.1f}s")

    def log_offsets(self) -> dict:
        run = self.lab.run_of("a")
        return {n: run.log_file(f"worker@{n}").stat().st_size for n in self.lab.nodes}

    def delays_since(self, offsets: dict, until: dict) -> list[float]:
        run = self.lab.run_of("a")
        out = []
        for n, off in offsets.items():
            with open(run.log_file(f"worker@{n}"), "rb") as f:
                f.seek(off)
                chunk = f.read(until[n] - off)
            out += [float(m.group(1)) for m in DELAY_RE.finditer(chunk)]
        return out

    # -- one measured window -----------------------------------------------------------
    def _counters(self) -> dict:
        """CPU and memory per process type (per site and in all), Redis calls, log offsets."""
        return {"a": usage(self.lab, ["a"]), "b": usage(self.lab, ["b"]), "all": usage(self.lab),
                "redis_a": redis_calls(self.lab.redis_ports["a"]), "redis_b": redis_calls(self.lab.redis_ports["b"]),
                "logs": self.log_offsets()}

    def _sample(self, halt: threading.Event, seen: dict) -> None:
        """Until *halt*: each unit's lag and health, and each process type's peak RSS."""
        while not halt.is_set():
            for vid in list(self.vols):
                try:
                    info = self.describe(vid)
                except Exception:  # noqa: BLE001 - a unit being written: next sample
                    continue
                seen["lag"].append(info.lag_seconds)
                if not self.healthy(info):
                    seen["always_ok"].discard(vid)
            for t, u in usage(self.lab).items():
                seen["rss_peak"][t] = max(seen["rss_peak"][t], u["rss_kb"])
            halt.wait(self.args.sample_every)

    def measure(self, duration: float) -> dict:
        seen = {"lag": [], "always_ok": set(self.vols), "rss_peak": {t: 0 for t in TYPES}}
        halt = threading.Event()
        c0, load0, t0 = self._counters(), os.getloadavg(), time.time()
        th = threading.Thread(target=self._sample, args=(halt, seen), daemon=True)
        th.start()
        time.sleep(duration)
        t1 = time.time()
        c1 = self._counters()
        halt.set()
        th.join()
        out = self._window(c0, c1, t0, t1, load0, seen)
        out.update(self._listings())
        return out

    def _listings(self) -> dict:
        """After a window, the lab still syncing: Redis memory per unit, `drsvc status` of all
        units, a /metrics scrape, and CreateVolume timed while the syncs go on."""
        mem = redis_memory(self.lab.redis_ports["a"])
        made = []
        for i in range(self.args.creates_under_load):
            t = time.perf_counter()
            self.create(f"load-{len(self.vols)}-{i}")
            made.append(time.perf_counter() - t)
        n = max(1, len(self.vols))
        return {"redis_a_memory_bytes": mem["used"], "redis_a_keys": mem["keys"],
                "redis_a_bytes_per_unit": round((mem["used"] - self.redis_base) / n),
                "status_all": status_all(self.lab, "a", self.args.page, self.args.listing_gap),
                "metrics_scrape": scrape_all(self.lab, "a", self.args.listing_gap),
                "create_under_load_ms": summary_ms(made)}

    def _window(self, c0: dict, c1: dict, t0: float, t1: float, load0, seen: dict) -> dict:
        """The figures of one measured window, from the counters at its two ends."""
        reps = [r for vid in self.vols for r in self.reports(vid) if t0 <= r["started_at"] <= t1]
        syncs = len(reps)
        phases: dict[str, list] = {}
        for r in reps:
            for k, v in (r.get("phases") or {}).items():
                if isinstance(v, (int, float)):
                    phases.setdefault(k, []).append(v)
        window = t1 - t0
        redis_a = c1["redis_a"] - c0["redis_a"]

        def cpu(part: str, per: float = 1.0, nd: int = 1) -> dict:
            return {t: round((c1[part][t]["cpu"] - c0[part][t]["cpu"]) / CLK / per, nd) for t in TYPES}
        return {
            "volumes": len(self.vols), "window_s": round(window, 1),
            "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "syncs": syncs, "syncs_per_s": round(syncs / window, 3),
            "expected_syncs_per_s": round(len(self.vols) / self.args.interval, 3),
            "sync_s": summary([r["duration_s"] for r in reps]),
            "bytes_on_wire_p50": pct([r["bytes_on_wire"] for r in reps], 50),
            "phase_p50_s": {k: round(statistics.median(v), 4) for k, v in sorted(phases.items())},
            "drift_s": summary(self.delays_since(c0["logs"], c1["logs"])),
            "lag_s": summary(seen["lag"]),
            "units_healthy_all_window": len(seen["always_ok"]),
            "redis_a_calls": redis_a, "redis_b_calls": c1["redis_b"] - c0["redis_b"],
            "redis_cmds_per_sync": round(redis_a / syncs, 1) if syncs else None,
            "cpu_s": cpu("all"), "cpu_s_site_a": cpu("a"), "cpu_s_site_b": cpu("b"),
            "cpu_s_per_sync": cpu("all", syncs, 4) if syncs else {t: None for t in TYPES},
            "rss_peak_mib": {t: round(seen["rss_peak"][t] / 1024, 1) for t in TYPES},
            "hwm_largest_mib": {t: round(c1["all"][t]["hwm_kb"] / 1024, 1) for t in TYPES},
            "procs": {t: c1["all"][t]["procs"] for t in TYPES},
        }

    # -- faults --------------------------------------------------------------------------
    def fault(self, name: str, affected: list[str], inject, recover, probe=None) -> dict:
        a = self.args
        from drsvc.replication.control import find_control
        fails0 = {v: (c.failures_total if (c := find_control(self.lab.pool(self.vols[v], "a"), v)) else 0)
                  for v in affected}
        bad_at: list[float] = []
        max_lag = 0.0
        worst = 0
        t0 = time.time()
        log(f"fault {name}: injecting ({len(affected)} units affected)")
        inject()
        deadline = time.time() + a.fault_hold
        while time.time() < deadline:
            n_bad, max_lag = self._poll(affected, bad_at, max_lag)
            worst = max(worst, n_bad)
            time.sleep(a.sample_every)
        recover()
        t_rec = time.time()
        probe_out = probe() if probe else None
        log(f"fault {name}: recovered after {t_rec - t0:.0f}s; waiting for every affected unit")
        # settled: every affected unit has synced since the recovery and reads healthy
        settled = None
        limit = t_rec + a.settle_intervals * a.interval
        while time.time() < limit:
            n_bad, max_lag = self._poll(affected, bad_at, max_lag)
            worst = max(worst, n_bad)
            fresh = sum(1 for v in affected if (r := self.reports(v)) and r[-1]["started_at"] >= t_rec)
            if n_bad == 0 and fresh == len(affected):
                settled = time.time()
                break
            time.sleep(a.sample_every)
        fails1 = {v: (c.failures_total if (c := find_control(self.lab.pool(self.vols[v], "a"), v)) else 0)
                  for v in affected}
        check = self.verify(random.Random(a.seed).sample(affected, min(a.verify, len(affected))))
        out = {"fault": name, "affected_units": len(affected), "held_s": round(t_rec - t0, 1),
               "units_degraded_max": worst, "max_lag_s": round(max_lag, 1),
               "degraded_s": round(max(bad_at) - min(bad_at) + a.sample_every, 1) if bad_at else 0.0,
               "failed_syncs": sum(fails1[v] - fails0[v] for v in affected),
               "all_synced_after_recovery_s": round(settled - t_rec, 1) if settled else None,
               **check}
        if probe_out is not None:
            out.update(probe_out)
        log(f"fault {name}: {json.dumps(out)}")
        return out

    def _poll(self, units, bad_at, max_lag):
        n_bad = 0
        for v in units:
            try:
                info = self.describe(v)
            except Exception:  # noqa: BLE001
                continue
            max_lag = max(max_lag, info.lag_seconds)
            if not self.healthy(info):
                n_bad += 1
        if n_bad:
            bad_at.append(time.time())
        return n_bad, max_lag

    def verify(self, units: list[str]) -> dict:
        """Writer paused: each unit syncs once more; its replica must match the source."""
        self.paused.set()
        time.sleep(1.0)                 # a write in progress finishes
        tp = time.time()
        try:
            pending = set(units)
            limit = tp + self.args.settle_intervals * self.args.interval
            while pending and time.time() < limit:
                pending = {v for v in pending if not ((r := self.reports(v)) and r[-1]["started_at"] > tp)}
                time.sleep(1.0)
            same = differ = 0
            for v in units:
                if v in pending:
                    continue
                if sha(self.image(v, "a")) == sha(self.image(v, "b")):
                    same += 1
                else:
                    differ += 1
            return {"verified": len(units), "replica_matches": same, "replica_differs": differ,
                    "not_synced_in_time": len(pending)}
        finally:
            self.paused.clear()

    def faults(self) -> None:
        lab = self.lab
        run = lab.run_of("a")
        on = {n: [v for v, node in self.vols.items() if node == n] for n in lab.nodes}
        everyone = list(self.vols)

        def kill_worker():
            os.killpg(run.pid("worker@n1"), signal.SIGKILL)
        self.out["faults"].append(self.fault("kill -9 worker@n1 (site a)", on["n1"], kill_worker,
                                             lambda: run.start("worker@n1")))
        self.out["faults"].append(self.fault("sshd of n2 at site b stopped", on["n2"],
                                             lambda: lab.stop_sshd("b", "n2"), lambda: lab.start_sshd("b", "n2")))
        self.out["faults"].append(self.fault("site a's Redis killed (SIGKILL), restarted after the hold",
                                             everyone, lambda: lab.stop_redis("a"), lambda: lab.start_redis("a")))

        def probe_controller():
            t = time.time()
            ok = None
            while time.time() - t < 120:
                try:
                    self.create(f"probe-{int(time.time() * 1000)}")
                    ok = time.time() - t
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
            return {"create_ok_after_restart_s": round(ok, 2) if ok is not None else None}

        def kill_controller():
            run.stop("controller", sig=signal.SIGKILL)
            # calls fail while it is down
            try:
                self.create(f"probe-down-{int(time.time())}")
                self._down_answer = "answered"
            except grpc.RpcError as e:
                self._down_answer = e.code().name
        out = self.fault("controller kill -9, restarted after the hold", everyone, kill_controller,
                         lambda: run.start("controller"), probe=probe_controller)
        out["create_while_down"] = getattr(self, "_down_answer", None)
        self.out["faults"].append(out)

    # -- whole run -----------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        stages = [int(x) for x in a.growth.split(",")] if a.growth else [a.volumes]
        try:
            t = time.monotonic()
            self.lab.build()
            self.lab.up()
            self.connect()
            self.redis_base = redis_memory(self.lab.redis_ports["a"])["used"]
            log(f"lab up in {time.monotonic() - t:.1f}s at {self.root}")
            w = threading.Thread(target=self.writer, daemon=True)
            for i, n in enumerate(stages):
                self.add(n - len(self.vols))
                if i == 0:
                    w.start()
                log(f"{len(self.vols)} volumes: warm-up {a.warmup}s")
                time.sleep(a.warmup)
                duration = a.duration if n == stages[-1] else a.growth_duration
                log(f"{len(self.vols)} volumes: measuring {duration}s")
                st = self.measure(duration)
                st["create_ms"] = summary_ms(self.create_s)
                st["create_ms_after_first_10"] = summary_ms(self.create_s[10:])
                st["enable_ms"] = summary_ms(self.enable_s)
                st["placement"] = {nd: sum(1 for x in self.vols.values() if x == nd) for nd in self.lab.nodes}
                self.out["stages"].append(st)
                log(f"stage: {json.dumps(st)}")
                self.checkpoint()
            if a.failovers:
                self.out["failovers"] = self.failovers(a.failovers)
                self.checkpoint()
            if a.faults:
                self.faults()
                self.checkpoint()
            if a.site_failover:
                self.out["site_failover"] = self.site_failover(a.verify, a.promote_parallel)
                self.checkpoint()
                if a.failback:
                    self.out["failback"] = self.failback(a.verify, a.promote_parallel)
                    self.checkpoint()
        finally:
            self.stop.set()
            self.paused.clear()
            if a.keep:
                log(f"lab kept at {self.root}")
            else:
                self.lab.teardown()
        return self.out

    def checkpoint(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.out, indent=1))


ROW = ("| units | drift p50/p99 s | healthy | CPU ms/sync sched/worker/api/ctl/redis/recv | Redis cmds/sync "
       "| Redis B/unit | RSS MiB sched/worker | /metrics s (KiB) | status all s (slowest page) | Create p99 ms | load |")


def growth_table(stages: list[dict]) -> str:
    """One row per size: the figures that must stay flat as units grow."""
    lines = [ROW, "|" + "---|" * (ROW.count("|") - 1)]
    for st in stages:
        c = st["cpu_s_per_sync"]
        ms = "/".join("-" if c[t] is None else f"{c[t] * 1000:.1f}"
                      for t in ("scheduler", "worker", "api", "controller", "redis", "sshd+receivers"))
        rss = st["rss_peak_mib"]
        sa, sc = st.get("status_all") or {}, st.get("metrics_scrape") or {}
        lines.append(
            f"| {st['volumes']} | {st['drift_s']['p50']}/{st['drift_s']['p99']} | "
            f"{st['units_healthy_all_window']}/{st['volumes']} | {ms} | {st['redis_cmds_per_sync']} | "
            f"{st.get('redis_a_bytes_per_unit')} | {rss['scheduler']}/{rss['worker']} | "
            f"{sc.get('s')} ({round((sc.get('bytes') or 0) / 1024)}) | {sa.get('s')} ({sa.get('slowest_page_s')}) | "
            f"{(st.get('create_under_load_ms') or {}).get('p99')} | {st['load_avg_after'][0]} |")
    return "\n".join(lines)


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def print_takeover(out: dict) -> None:
    if sf := out.get("site_failover"):
        how = "one PromoteAll" if sf["parallel"] == "PromoteAll" else f"{sf['parallel']} PromoteVolume calls at a time"
        print(f"site failover of {sf['units']} units: forced promotes at b ({how}) took "
              f"{sf['takeover_s']} s (one promote p50 {sf['promote_ms']['p50']} ms, p99 {sf['promote_ms']['p99']} ms); "
              f"primary at b {sf['primary_at_b']}, not {sf['not_primary']}, promoted twice {sf['promoted_twice']}; "
              f"replicas against a's image of their generation: {sf['checksummed']}")
    if fb := out.get("failback"):
        how = (f"by one DemoteAll in {fb['demote_all_s']} s" if fb["parallel"] == "DemoteAll"
               else f"(force, {fb['parallel']} at a time)")
        print(f"failback of {fb['units']} units: a up in {fb['site_up_s']} s, then every unit demoted and resynced "
              f"{how} and ready at a in {fb['failback_s']} s (one unit p50 "
              f"{fb['unit_ms']['p50']} ms, p99 {fb['unit_ms']['p99']} ms; ready {fb['ready']}, failed {fb['failed']}); "
              f"b shipped {fb['bytes_on_wire']} bytes for {fb['bytes_of_units']} bytes of units; "
              f"a's copies equal to b's: {fb['checksummed']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    ap.add_argument("--volumes", type=int, default=600)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--interval", type=int, default=60)
    ap.add_argument("--warmup", type=float, default=90, help="seconds after enabling, before measuring")
    ap.add_argument("--duration", type=float, default=300, help="measured window (the last stage's)")
    ap.add_argument("--growth", default="", help="sizes measured in turn on one lab, e.g. 600,2000,5000,10000; "
                    "one table row per size")
    ap.add_argument("--page", type=int, default=500, help="ListReplications page size of the status timing")
    ap.add_argument("--listing-gap", type=float, default=GAP_S,
                    help="seconds between the first and the next pass of the status and /metrics timings")
    ap.add_argument("--creates-under-load", type=int, default=10, help="CreateVolume calls timed after each window")
    ap.add_argument("--growth-duration", type=float, default=120, help="window of the earlier growth stages")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--pool-size", default="4G", help="each node's loop XFS (sparse)")
    ap.add_argument("--failovers", type=int, default=10,
                    help="planned failovers (Demote at a, Promote at b) timed after the last window")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--site-failover", action="store_true",
                    help="last: site a killed, then every unit promoted at b with force, timed and checked")
    ap.add_argument("--promote-parallel", type=int, default=16, help="--site-failover's PromoteVolume calls at once")
    ap.add_argument("--failback", action="store_true",
                    help="after --site-failover: site a back, every unit demoted and resynced there (force), timed")
    ap.add_argument("--promote-all", action="store_true",
                    help="--site-failover by one PromoteAll at b's controller (a batch per node), not PromoteVolume "
                         "calls; and --failback by one DemoteAll (resync) at a's")
    ap.add_argument("--fault-hold", type=float, default=30, help="seconds each fault lasts")
    ap.add_argument("--settle-intervals", type=float, default=3.0)
    ap.add_argument("--verify", type=int, default=20, help="affected units checksummed after each fault")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--out", default="", help="also write the results here as they come")
    ap.add_argument("--keep", action="store_true", help="leave the lab running")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench.scale needs root (loop devices, mounts)")
    out = Scale(args).run()
    for st in out["stages"]:
        print(f"{st['volumes']} volumes every {args.interval}s, window {st['window_s']}s, load {st['load_avg_after']}: "
              f"{st['syncs_per_s']} syncs/s (expected {st['expected_syncs_per_s']}); sync p50 {st['sync_s']['p50']}s "
              f"p99 {st['sync_s']['p99']}s; drift p50 {st['drift_s']['p50']}s p99 {st['drift_s']['p99']}s; "
              f"lag p50 {st['lag_s']['p50']}s p99 {st['lag_s']['p99']}s max {st['lag_s']['max']}s; "
              f"healthy {st['units_healthy_all_window']}/{st['volumes']}; redis cmds/sync {st['redis_cmds_per_sync']}; "
              f"CreateVolume p50 {st['create_ms']['p50']} ms p99 {st['create_ms']['p99']} ms")
        print(f"  phases p50 (s): {st['phase_p50_s']}")
        print(f"  cpu s: {st['cpu_s']}  peak rss MiB: {st['rss_peak_mib']}")
    print(growth_table(out["stages"]))
    if fo := out.get("failovers"):
        print(f"{fo['failovers']} planned failovers while {fo['units_syncing']} units sync: "
              f"DemoteVolume p50 {fo['demote_ms']['p50']} ms p99 {fo['demote_ms']['p99']} ms; "
              f"PromoteVolume p50 {fo['promote_ms']['p50']} ms p99 {fo['promote_ms']['p99']} ms")
    for f in out["faults"]:
        print(f"fault: {json.dumps(f)}")
    print_takeover(out)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
