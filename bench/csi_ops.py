"""CSI operation latencies on a reflink XFS pool, beside a plain full copy.

    python -m bench.csi_ops [--json] [--volumes 200] [--repeat 5] [--cases create,copy1g,copy10g]
                            [--hostpath /path/to/hostpathplugin] [--capacity-mib 64] [--runs 3]

Starts the real plugin on a fresh 40 GiB sparse loop-mounted XFS pool, then
times CreateVolume/DeleteVolume, and CreateSnapshot and clone-by-CreateVolume
of a volume holding 1 GiB of random data at 1 GiB and at 10 GiB volume size.
The peer figure is `cp --reflink=never --sparse=always` of the same 1 GiB
image: what a snapshot would cost without reflink. Needs root.

CreateVolume/DeleteVolume peer: with ``--hostpath BINARY`` the
Kubernetes CSI hostpath driver is started beside the plugin (its state dir on
the same XFS), and both get the same requests over their unix sockets in the
same run, interleaved (the order alternates every pair), each after the same
warm-up: a mount-access volume of ``--capacity-mib``. The ratio is drsvc's
p50 (p99) over the hostpath driver's. Without the binary the peer is reported
as not measured. Note that the two do not promise the same thing: drsvc's
CreateVolume returns after its metadata and image are fsynced (file and
directory); the hostpath driver rewrites its state file without fsync.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from csi_plugin.gen import csi_pb2, csi_pb2_grpc
from drsvc.host.reflink import supports_reflink
from drsvc_lab import mount_fs, unmount_under

MiB, GiB = 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parents[1]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def block_cap():
    return csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                    access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))


def mount_cap():
    return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                    access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))


def wait_socket(sock: Path, proc: subprocess.Popen, log: Path, what: str) -> grpc.Channel:
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start; see {log}")
        time.sleep(0.05)
    channel = grpc.insecure_channel(f"unix://{sock}")
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Driver:
    """One CSI controller over its unix socket: CreateVolume/DeleteVolume with one request shape."""

    def __init__(self, name: str, channel: grpc.Channel):
        self.name, self.channel = name, channel
        self.ctl = csi_pb2_grpc.ControllerStub(channel)

    def create(self, name: str, size: int, cap=None) -> str:
        req = csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                                          volume_capabilities=[cap or mount_cap()])
        return self.ctl.CreateVolume(req, timeout=120).volume.volume_id

    def delete(self, volume_id: str) -> None:
        self.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id), timeout=120)


class Hostpath:
    """The hostpath reference driver (a binary built elsewhere), its state dir on *statedir*."""

    def __init__(self, binary: Path, work: Path, statedir: Path):
        self.binary, self.sock, self.statedir = binary, work / "hostpath.sock", statedir
        self.logpath = work / "hostpath.log"
        self.proc = None

    def start(self) -> Driver:
        self.statedir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.logpath, "ab")  # noqa: SIM115 - the driver writes it until stop()
        self.proc = subprocess.Popen(
            [str(self.binary), "--endpoint", f"unix://{self.sock}", "--nodeid", "bench",
             "--drivername", "hostpath.csi.k8s.io", "--statedir", str(self.statedir)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        return Driver("hostpath", wait_socket(self.sock, self.proc, self.logpath, "hostpath driver"))

    def stop(self) -> None:
        stop(self.proc)
        if self.proc is not None:
            self.log.close()


class Bench:
    def __init__(self, work: Path, hostpath: Path | None = None):
        self.work = work
        self.img, self.mnt = work / "pool.img", work / "mnt"
        self.pool, self.sock = self.mnt / "pool", work / "csi.sock"
        self.proc = None
        self.mounted = False
        self.hostpath = Hostpath(hostpath, work, self.mnt / "hostpath-state") if hostpath else None
        self.peer: Driver | None = None

    # -- setup / teardown ---------------------------------------------------------
    def setup(self) -> None:
        mount_fs(self.img, self.mnt, "40G")
        self.mounted = True
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.log = open(self.work / "plugin.log", "ab")  # noqa: SIM115 - the plugin writes it until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "csi_plugin", "--endpoint", f"unix://{self.sock}", "--pool", str(self.pool),
             "--node-id", "bench", "--log-level", "WARNING"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.work, env=env, start_new_session=True)
        self.channel = wait_socket(self.sock, self.proc, self.work / "plugin.log", "plugin")
        self.ctl = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        self.drsvc = Driver("drsvc", self.channel)
        if self.hostpath is not None:
            self.peer = self.hostpath.start()

    def teardown(self) -> None:
        if self.peer is not None:
            self.peer.channel.close()
        if self.hostpath is not None:
            self.hostpath.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.channel.close()
        stop(self.proc)
        if self.mounted:
            unmount_under(self.work)    # volumes the run left staged, their loops, the pool itself
        shutil.rmtree(self.work, ignore_errors=True)

    # -- operations -----------------------------------------------------------------
    def create(self, name: str, size: int, source_volume: str = "") -> str:
        req = csi_pb2.CreateVolumeRequest(name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                                          volume_capabilities=[block_cap()])
        if source_volume:
            req.volume_content_source.volume.volume_id = source_volume
        return self.ctl.CreateVolume(req, timeout=600).volume.volume_id

    def delete(self, volume_id: str) -> None:
        self.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id), timeout=120)

    def snapshot(self, name: str, volume_id: str) -> str:
        return self.ctl.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
            name=name, source_volume_id=volume_id), timeout=600).snapshot.snapshot_id

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.ctl.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snapshot_id), timeout=120)

    def fill(self, volume_id: str, data_seed: int, scattered: int = 0, data_bytes: int = GiB) -> int:
        """Write *data_bytes* of random data (at most the volume's size) from offset 0 through the
        published block device, then *scattered* 1 MiB writes across the rest; returns the bytes written."""
        staging, target = self.work / f"stage-{volume_id}", self.work / f"target-{volume_id}"
        self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), volume_capability=block_cap()), timeout=120)
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=block_cap()), timeout=120)
        rng = random.Random(data_seed)
        fd = os.open(target, os.O_WRONLY)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            head = min(data_bytes, size)
            written = 0
            for off in range(0, head, 16 * MiB):
                n = min(16 * MiB, head - off)
                os.pwrite(fd, rng.randbytes(n), off)
                written += n
            # scattered 1 MiB writes across the rest: extents a snapshot must share
            first = -(-head // MiB)           # the first whole MiB after the head
            slots = size // MiB - first
            for slot in rng.sample(range(max(slots, 0)), min(scattered, max(slots, 0))):
                os.pwrite(fd, rng.randbytes(MiB), (first + slot) * MiB)
                written += MiB
            os.fsync(fd)
        finally:
            os.close(fd)
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=str(target)), timeout=120)
        self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging)), timeout=120)
        return written

    # -- measurements -----------------------------------------------------------------
    def create_delete(self, n: int, size: int = 64 * MiB, warmup: int = 5, runs: int = 1) -> dict:
        """*runs* runs of *n* CreateVolume+DeleteVolume pairs on drsvc and, when given, the hostpath driver.

        Same request (mount access, *size* bytes) on both, interleaved pair by pair with the
        order alternating, so both see the same machine load; *warmup* pairs each are not timed
        (before every run). Each figure is the median over the runs of that run's percentile."""
        drivers = [self.drsvc] + ([self.peer] if self.peer is not None else [])
        load = os.getloadavg()[0]
        per_run = []
        for r in range(runs):
            times = {d.name: ([], []) for d in drivers}
            run_load = os.getloadavg()[0]
            for i in range(-warmup, n):
                for d in (drivers if i % 2 == 0 else drivers[::-1]):
                    t, vid = timed(lambda d=d, i=i, r=r: d.create(f"cd-{r}-{i + warmup}", size))
                    t2, _ = timed(lambda d=d, vid=vid: d.delete(vid))
                    if i >= 0:
                        times[d.name][0].append(t)
                        times[d.name][1].append(t2)
            per_run.append({"load_1m": run_load, "drivers": {name: {
                "create_p50_ms": ms(pct(creates, 50)), "create_p99_ms": ms(pct(creates, 99)),
                "delete_p50_ms": ms(pct(deletes, 50)), "delete_p99_ms": ms(pct(deletes, 99))}
                for name, (creates, deletes) in times.items()}})
        keys = ("create_p50_ms", "create_p99_ms", "delete_p50_ms", "delete_p99_ms")
        out = {"n": n, "runs": per_run, "capacity_bytes": size, "access_type": "mount", "warmup": warmup,
               "load_1m_before": load, "load_1m_after": os.getloadavg()[0],
               "drivers": {d.name: {k: round(statistics.median(run["drivers"][d.name][k] for run in per_run), 2)
                                    for k in keys} for d in drivers}}
        out.update(out["drivers"]["drsvc"])            # the figures older readers look for
        peer = out["drivers"].get("hostpath")
        out["hostpath_measured"] = peer is not None
        out["ratio"] = None if peer is None else {k: round(out[k] / peer[k], 2) if peer[k] else None for k in keys}
        for run in per_run:
            hp = run["drivers"].get("hostpath")
            run["ratio"] = None if hp is None else {
                k: round(run["drivers"]["drsvc"][k] / hp[k], 2) if hp[k] else None for k in keys}
        return out

    def copies(self, size: int, repeat: int, scattered: int, data_bytes: int = GiB) -> dict:
        tag = f"{size // GiB}g"
        vid = self.create(f"src-{tag}", size)
        written = self.fill(vid, data_seed=7, scattered=scattered, data_bytes=data_bytes)
        subprocess.run(["sync"], check=True)
        snaps, clones = [], []
        for i in range(repeat):
            t, sid = timed(lambda i=i: self.snapshot(f"snap-{tag}-{i}", vid))
            snaps.append(t)
            t, cid = timed(lambda i=i: self.create(f"clone-{tag}-{i}", size, source_volume=vid))
            clones.append(t)
            self.delete(cid)
            self.delete_snapshot(sid)
        image = self.pool / "images" / f"{vid}.img"
        out = {"volume_bytes": size, "data_bytes": written,
               "snapshot_ms": ms(statistics.median(snaps)), "snapshot_max_ms": ms(max(snaps)),
               "clone_ms": ms(statistics.median(clones)), "clone_max_ms": ms(max(clones))}
        if size == GiB:                  # a full copy of the 1 GiB image: what a copy without reflink costs
            dst = self.mnt / "full-copy.img"
            runs = []
            for _ in range(max(1, min(repeat, 3))):
                dst.unlink(missing_ok=True)
                subprocess.run(["sync"], check=True)
                t, _ = timed(lambda: subprocess.run(
                    ["cp", "--reflink=never", "--sparse=always", str(image), str(dst)], check=True))
                runs.append(t)
            dst.unlink(missing_ok=True)
            out["full_copy_ms"] = ms(statistics.median(runs))
        self.delete(vid)
        return out


CASES = ("create", "copy1g", "copy10g")


def report(result: dict, repeat: int) -> list[str]:
    lines = []
    cd = result.get("create_delete")
    if cd:
        peer, ratio = cd["drivers"].get("hostpath"), cd["ratio"]
        lines.append(f"CreateVolume/DeleteVolume: {len(cd['runs'])} run(s) of {cd['n']} pairs, mount access, "
                     f"{cd['capacity_bytes'] // MiB} MiB, {cd['warmup']} warm-up pairs a run; load average "
                     f"{cd['load_1m_before']:.2f} -> {cd['load_1m_after']:.2f}")
        if len(cd["runs"]) > 1:
            for i, run in enumerate(cd["runs"]):
                d, hp = run["drivers"]["drsvc"], run["drivers"].get("hostpath")
                lines.append(f"  run {i + 1} (load {run['load_1m']:.2f}): create p50 drsvc {d['create_p50_ms']:.2f}"
                             + (f" hostpath {hp['create_p50_ms']:.2f} ratio {run['ratio']['create_p50_ms']:.2f}x"
                                if hp else "") + f", delete p50 drsvc {d['delete_p50_ms']:.2f}"
                             + (f" hostpath {hp['delete_p50_ms']:.2f}" if hp else ""))
            lines.append("medians of the runs:")
        lines.append(f"{'operation':<14}{'drsvc p50':>10}{'p99':>8}{'hostpath p50':>14}{'p99':>8}"
                     f"{'ratio p50':>11}{'p99':>7}")
        for op in ("create", "delete"):
            d = cd["drivers"]["drsvc"]
            row = f"{op.capitalize() + 'Volume':<14}{d[op + '_p50_ms']:>10.2f}{d[op + '_p99_ms']:>8.2f}"
            if peer is None:
                row += f"{'-':>14}{'-':>8}{'-':>11}{'-':>7}"
            else:
                row += (f"{peer[op + '_p50_ms']:>14.2f}{peer[op + '_p99_ms']:>8.2f}"
                        f"{ratio[op + '_p50_ms']:>10.2f}x{ratio[op + '_p99_ms']:>6.2f}x")
            lines.append(row)
        if peer is None:
            lines.append("hostpath driver: not measured (pass --hostpath /path/to/hostpathplugin)")
    copies = [(k, result[k]) for k in ("copy_1g", "copy_10g") if k in result]
    if copies:
        lines.append(f"snapshot/clone: median and max of {repeat}")
        lines.append(f"{'operation':<52}{'median ms':>10}{'max ms':>10}  peer (ms)")
    for _, c in copies:
        what = f"{c['volume_bytes'] / GiB:.0f} GiB vol / {c['data_bytes'] / GiB:.2f} GiB data"
        peer = f"cp full copy {c['full_copy_ms']:.0f}" if "full_copy_ms" in c else ""
        lines.append(f"{'CreateSnapshot, ' + what:<52}{c['snapshot_ms']:>10.1f}{c['snapshot_max_ms']:>10.1f}  {peer}")
        lines.append(f"{'Clone, ' + what:<52}{c['clone_ms']:>10.1f}{c['clone_max_ms']:>10.1f}  {peer}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line holding every figure")
    ap.add_argument("--volumes", type=int, default=200, help="timed CreateVolume/DeleteVolume pairs per driver")
    ap.add_argument("--warmup", type=int, default=5, help="untimed pairs per driver before each run")
    ap.add_argument("--runs", type=int, default=1, help="create/delete runs; figures are medians of the runs")
    ap.add_argument("--capacity-mib", type=int, default=64, help="capacity asked by each CreateVolume")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--hostpath", type=Path, help="a hostpathplugin binary: measure it beside drsvc")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := sorted(set(cases) - set(CASES)):
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    if args.hostpath is not None and not os.access(args.hostpath, os.X_OK):
        ap.error(f"--hostpath {args.hostpath} is not an executable file")
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None or shutil.which("losetup") is None:
        print("needs root, mkfs.xfs and losetup", file=sys.stderr)
        return 2
    b = Bench(Path(tempfile.mkdtemp(prefix="drsvc-bench-")), hostpath=args.hostpath)
    try:
        b.setup()
        result = {"reflink": supports_reflink(b.mnt)}
        if "create" in cases:
            result["create_delete"] = b.create_delete(args.volumes, args.capacity_mib * MiB, args.warmup,
                                                       max(1, args.runs))
        if "copy1g" in cases:
            result["copy_1g"] = b.copies(GiB, args.repeat, scattered=0)
        if "copy10g" in cases:
            result["copy_10g"] = b.copies(10 * GiB, args.repeat, scattered=64)
    finally:
        b.teardown()
    print("\n".join(report(result, args.repeat)))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
