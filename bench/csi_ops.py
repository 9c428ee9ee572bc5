"""CSI operation latencies on a reflink XFS pool, beside a plain full copy.

    python -m bench.csi_ops [--json] [--volumes 200] [--repeat 5]

Starts the real plugin on a fresh 40 GiB sparse loop-mounted XFS pool, then
times CreateVolume/DeleteVolume, and CreateSnapshot and clone-by-CreateVolume
of a volume holding 1 GiB of random data at 1 GiB and at 10 GiB volume size.
The peer figure is `cp --reflink=never --sparse=always` of the same 1 GiB
image: what a snapshot would cost without reflink. Needs root.
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


class Bench:
    def __init__(self, work: Path):
        self.work = work
        self.img, self.mnt = work / "pool.img", work / "mnt"
        self.pool, self.sock = self.mnt / "pool", work / "csi.sock"
        self.proc = None
        self.mounted = False

    # -- setup / teardown ---------------------------------------------------------
    def setup(self) -> None:
        self.mnt.mkdir()
        subprocess.run(["truncate", "-s", "40G", str(self.img)], check=True)
        subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(self.img)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(self.img), str(self.mnt)], check=True)
        self.mounted = True
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.log = open(self.work / "plugin.log", "ab")  # noqa: SIM115 - the plugin writes it until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "csi_plugin", "--endpoint", f"unix://{self.sock}", "--pool", str(self.pool),
             "--node-id", "bench", "--log-level", "WARNING"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.work, env=env, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"plugin did not start; see {self.work / 'plugin.log'}")
            time.sleep(0.05)
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.ctl = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def teardown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.channel.close()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.mounted:
            # volumes the run left staged, then their loops, then the pool itself
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                target = line.split()[4]
                if target.startswith(str(self.work) + "/") and target != str(self.mnt):
                    subprocess.run(["umount", "-l", target], capture_output=True)
            for entry in Path("/sys/block").glob("loop*"):
                try:
                    backing = (entry / "loop" / "backing_file").read_text().strip()
                except OSError:
                    continue
                if backing.startswith(str(self.pool) + "/"):
                    subprocess.run(["losetup", "-d", f"/dev/{entry.name}"], capture_output=True)
            subprocess.run(["umount", str(self.mnt)], capture_output=True)
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

    def fill(self, volume_id: str, data_seed: int, scattered: int = 0) -> None:
        """Write 1 GiB of random data through the published block device."""
        staging, target = self.work / f"stage-{volume_id}", self.work / f"target-{volume_id}"
        self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), volume_capability=block_cap()), timeout=120)
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=block_cap()), timeout=120)
        rng = random.Random(data_seed)
        fd = os.open(target, os.O_WRONLY)
        try:
            for off in range(0, GiB, 16 * MiB):
                os.pwrite(fd, rng.randbytes(16 * MiB), off)
            size = os.lseek(fd, 0, os.SEEK_END)
            # scattered 1 MiB writes across the rest: extents a snapshot must share
            for _ in range(scattered):
                off = rng.randrange(GiB, size - MiB) // MiB * MiB
                os.pwrite(fd, rng.randbytes(MiB), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=str(target)), timeout=120)
        self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging)), timeout=120)

    # -- measurements -----------------------------------------------------------------
    def create_delete(self, n: int) -> dict:
        creates, deletes = [], []
        for i in range(n):
            t, vid = timed(lambda i=i: self.create(f"cd-{i}", 64 * MiB))
            creates.append(t)
            t, _ = timed(lambda vid=vid: self.delete(vid))
            deletes.append(t)
        return {"n": n,
                "create_p50_ms": ms(pct(creates, 50)), "create_p99_ms": ms(pct(creates, 99)),
                "delete_p50_ms": ms(pct(deletes, 50)), "delete_p99_ms": ms(pct(deletes, 99))}

    def copies(self, size: int, repeat: int, scattered: int) -> dict:
        tag = f"{size // GiB}g"
        vid = self.create(f"src-{tag}", size)
        self.fill(vid, data_seed=7, scattered=scattered)
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
        out = {"volume_bytes": size, "data_bytes": GiB + scattered * MiB,
               "snapshot_ms": ms(statistics.median(snaps)), "snapshot_max_ms": ms(max(snaps)),
               "clone_ms": ms(statistics.median(clones)), "clone_max_ms": ms(max(clones))}
        if size == GiB:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line holding every figure")
    ap.add_argument("--volumes", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None or shutil.which("losetup") is None:
        print("needs root, mkfs.xfs and losetup", file=sys.stderr)
        return 2
    b = Bench(Path(tempfile.mkdtemp(prefix="drsvc-bench-")))
    try:
        b.setup()
        result = {"reflink": supports_reflink(b.mnt), "create_delete": b.create_delete(args.volumes),
                  "copy_1g": b.copies(GiB, args.repeat, scattered=0),
                  "copy_10g": b.copies(10 * GiB, args.repeat, scattered=64)}
    finally:
        b.teardown()
    cd, one, ten = result["create_delete"], result["copy_1g"], result["copy_10g"]
    rows = [
        ("CreateVolume (64 MiB, empty)", f"{cd['create_p50_ms']:.1f}", f"{cd['create_p99_ms']:.1f}", ""),
        ("DeleteVolume", f"{cd['delete_p50_ms']:.1f}", f"{cd['delete_p99_ms']:.1f}", ""),
        ("CreateSnapshot, 1 GiB vol / 1 GiB data", f"{one['snapshot_ms']:.1f}", f"{one['snapshot_max_ms']:.1f}",
         f"cp full copy {one['full_copy_ms']:.0f}"),
        ("Clone, 1 GiB vol / 1 GiB data", f"{one['clone_ms']:.1f}", f"{one['clone_max_ms']:.1f}",
         f"cp full copy {one['full_copy_ms']:.0f}"),
        ("CreateSnapshot, 10 GiB vol / 1.06 GiB data", f"{ten['snapshot_ms']:.1f}", f"{ten['snapshot_max_ms']:.1f}", ""),
        ("Clone, 10 GiB vol / 1.06 GiB data", f"{ten['clone_ms']:.1f}", f"{ten['clone_max_ms']:.1f}", ""),
    ]
    print(f"CSI ops on a reflink XFS pool ({cd['n']} create/delete pairs; "
          f"snapshot/clone median and max of {args.repeat})")
    print(f"{'operation':<44}{'p50/median ms':>14}{'p99/max ms':>12}  peer (ms)")
    for name, a, b_, peer in rows:
        print(f"{name:<44}{a:>14}{b_:>12}  {peer}")
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
