"""CreateVolume and DeleteVolume through a multi-node site's controller, beside a one-node plugin.

    python -m bench.nodes [--nodes 3] [--volumes 200] [--runs 3] [--threads 1,8] [--json]

The controller holds no pool: each CreateVolume asks every node's free space (a
drsvc.node task per node, at once), claims the name in Redis, and sends the create to
the chosen node's queue, where that node's Celery worker makes the image on its own
loop-mounted XFS. The one-node plugin (same host, same request shape) makes it in
process. Figures are per-call latencies over the unix socket, medians of the runs, for
sequential calls and for several client threads at once; the placement spread over the
nodes is printed too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.csi_ops import Bench, Driver, ms, pct
from csi_plugin.gen import csi_pb2
from drsvc_lab import NodesLab

MiB = 1 << 20
NODE = "topology.drsvc.io/node"


def run_pairs(driver: Driver, prefix: str, n: int, threads: int, spread: dict | None = None) -> dict:
    """n CreateVolume calls, then n DeleteVolume calls, by *threads* clients at once."""
    def create(i):
        t0 = time.perf_counter()
        req = csi_pb2.CreateVolumeRequest(name=f"{prefix}-{i}", capacity_range=csi_pb2.CapacityRange(
            required_bytes=64 * MiB), volume_capabilities=[csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))])
        vol = driver.ctl.CreateVolume(req, timeout=120).volume
        return time.perf_counter() - t0, vol

    def delete(vol_id):
        t0 = time.perf_counter()
        driver.delete(vol_id)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(threads) as pool:
        made = list(pool.map(create, range(n)))
        deleted = list(pool.map(delete, [v.volume_id for _, v in made]))
    if spread is not None:
        for _, v in made:
            node = dict(v.accessible_topology[0].segments).get(NODE, "-")
            spread[node] = spread.get(node, 0) + 1
    c = [t for t, _ in made]
    return {"create_p50_ms": ms(statistics.median(c)), "create_p99_ms": ms(pct(c, 99)),
            "delete_p50_ms": ms(statistics.median(deleted)), "delete_p99_ms": ms(pct(deleted, 99))}


def median_of(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--volumes", type=int, default=200, help="CreateVolume/DeleteVolume pairs per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", default="1,8", help="client threads, comma-separated cases")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench.nodes needs root (loop devices, mounts)")
    work = Path(tempfile.mkdtemp(prefix="drsvc-bench-nodes-"))
    lab = NodesLab(work / "site", nodes=[f"n{i + 1}" for i in range(args.nodes)], pool_size="4G")
    one = Bench(work / "one")
    (work / "one").mkdir()
    result = {"nodes": args.nodes, "volumes": args.volumes, "runs": args.runs, "cases": {}}
    try:
        lab.build()
        lab.up()
        ch = grpc.insecure_channel(lab.endpoint)
        grpc.channel_ready_future(ch).result(timeout=30)
        cluster = Driver("controller", ch)
        one.setup()
        for threads in [int(t) for t in args.threads.split(",")]:
            spread: dict = {}
            multi, single = [], []
            for r in range(args.runs):
                # interleaved, same request shape, same host
                run_pairs(cluster, f"warm-{threads}-{r}", 5, 1)
                multi.append(run_pairs(cluster, f"m-{threads}-{r}", args.volumes, threads, spread))
                single.append(run_pairs(one.drsvc, f"s-{threads}-{r}", args.volumes, threads))
            result["cases"][f"threads={threads}"] = {"multi_node": median_of(multi), "one_node": median_of(single),
                                                     "spread": spread, "load": os.getloadavg()[0]}
        ch.close()
    finally:
        one.teardown()
        lab.teardown()
    for case, r in result["cases"].items():
        print(f"{case}: controller of {args.nodes} nodes (node tasks)  create p50 {r['multi_node']['create_p50_ms']} ms"
              f"  p99 {r['multi_node']['create_p99_ms']} ms  delete p50 {r['multi_node']['delete_p50_ms']} ms"
              f"  p99 {r['multi_node']['delete_p99_ms']} ms")
        print(f"{case}: one-node plugin (in process)          create p50 {r['one_node']['create_p50_ms']} ms"
              f"  p99 {r['one_node']['create_p99_ms']} ms  delete p50 {r['one_node']['delete_p50_ms']} ms"
              f"  p99 {r['one_node']['delete_p99_ms']} ms")
        print(f"{case}: placement spread {r['spread']}  (load {r['load']:.1f})")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
