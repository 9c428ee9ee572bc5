"""GetMetadataDelta's time for 1% and 10% of 1 GiB changed, beside a hash comparison.

    python -m bench.snapshot_metadata [--json] [--repeat 5]

Starts the real plugin on a fresh sparse loop-mounted XFS pool, writes 1 GiB of
random data through a published block volume, snapshots it (base), rewrites
1% (then 10%) of it in scattered 64 KiB writes, snapshots again (target) and
times a full GetMetadataDelta stream (VARIABLE_LENGTH) over the plugin socket.
The peer figure hashes both images block by block (4 KiB, the replication
engine's digests: drsvc.replication.common.blockmap.hash_image) and compares the
digests: what a tool without FIEMAP on reflink snapshots has to do. Both read
warm page caches after the first run; medians of --repeat runs. Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.csi_ops import GiB, MiB, Bench, block_cap, ms, timed
from csi_plugin.gen import csi_pb2, csi_pb2_grpc
from drsvc.replication.common import DIGEST, hash_image

BS = 4096
WRITE = 64 * 1024


def rewrite(bench: Bench, volume_id: str, fraction: float, seed: int) -> int:
    """Rewrite *fraction* of the first GiB in scattered 64 KiB writes; returns bytes changed."""
    staging, target = bench.work / f"stage-r-{seed}", bench.work / f"target-r-{seed}"
    bench.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
        volume_id=volume_id, staging_target_path=str(staging), volume_capability=block_cap()), timeout=120)
    bench.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
        volume_capability=block_cap()), timeout=120)
    rng = random.Random(seed)
    slots = rng.sample(range(GiB // WRITE), int(GiB * fraction) // WRITE)
    fd = os.open(target, os.O_WRONLY)
    try:
        for s in sorted(slots):
            os.pwrite(fd, rng.randbytes(WRITE), s * WRITE)
        os.fsync(fd)
    finally:
        os.close(fd)
    bench.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=volume_id, target_path=str(target)), timeout=120)
    bench.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
        volume_id=volume_id, staging_target_path=str(staging)), timeout=120)
    return len(slots) * WRITE


def delta_bytes(stub, base: str, target: str) -> int:
    total = 0
    for msg in stub.GetMetadataDelta(csi_pb2.GetMetadataDeltaRequest(
            base_snapshot_id=base, target_snapshot_id=target), timeout=600):
        total += sum(b.size_bytes for b in msg.block_metadata)
    return total


def hash_compare(a: Path, b: Path) -> int:
    """Changed bytes found by hashing both whole images per 4 KiB block and comparing digests."""
    maps = []
    for path in (a, b):
        fd = os.open(path, os.O_RDONLY)
        try:
            maps.append(dict(hash_image(fd, os.fstat(fd).st_size, BS, chunk=8 * MiB)))
        finally:
            os.close(fd)
    changed = 0
    for first in maps[0].keys() | maps[1].keys():
        x, y = maps[0].get(first), maps[1].get(first)
        if x == y:
            continue
        if x is None or y is None or len(x) != len(y):
            changed += len(x or y) // DIGEST * BS
            continue
        changed += sum(BS for i in range(0, len(x), DIGEST) if x[i:i + DIGEST] != y[i:i + DIGEST])
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    bench = Bench(Path(tempfile.mkdtemp(prefix="drsvc-bench-md-")))
    results = {"machine_load_1m": os.getloadavg()[0], "repeat": args.repeat, "cases": []}
    try:
        bench.setup()
        stub = csi_pb2_grpc.SnapshotMetadataStub(bench.channel)
        vid = bench.create("md-src", GiB)
        bench.fill(vid, data_seed=11)
        base = bench.snapshot("md-base", vid)
        for i, fraction in enumerate((0.01, 0.10)):
            written = rewrite(bench, vid, fraction, seed=100 + i)
            subprocess.run(["sync"], check=True)
            target = bench.snapshot(f"md-target-{i}", vid)
            a, b = (bench.pool / "snapshots" / f"{s}.img" for s in (base, target))
            deltas, hashes = [], []
            for _ in range(args.repeat):
                t, reported = timed(lambda b0=base, t0=target: delta_bytes(stub, b0, t0))
                deltas.append(t)
                t, compared = timed(lambda a0=a, b0=b: hash_compare(a0, b0))
                hashes.append(t)
            results["cases"].append({
                "changed_fraction": fraction, "bytes_rewritten": written,
                "delta_reported_bytes": reported, "hash_changed_bytes": compared,
                "get_metadata_delta_ms": ms(statistics.median(deltas)),
                "hash_compare_ms": ms(statistics.median(hashes)),
                "speedup": round(statistics.median(hashes) / statistics.median(deltas), 1)})
            base = target
            # the next case diffs against this target: its change set is only its own rewrite
    finally:
        bench.teardown()
    results["machine_load_1m_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for c in results["cases"]:
            print(f"{c['changed_fraction']:>5.0%} of 1 GiB: GetMetadataDelta {c['get_metadata_delta_ms']} ms "
                  f"({c['delta_reported_bytes']} B), hash compare {c['hash_compare_ms']} ms "
                  f"({c['hash_changed_bytes']} B), x{c['speedup']}")
        print(f"load average {results['machine_load_1m']:.2f} -> {results['machine_load_1m_after']:.2f} (shared machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
