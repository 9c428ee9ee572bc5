"""The operator's listings over one pool of many units: `python -m bench.listing --json`.

    python -m bench.listing [--units 2000] [--sizes 500,2000] [--page 100] [--rounds 5] [--json]

One pool on the local filesystem, grown to each of --sizes: volumes made by CreateVolume's
code (VolumeService.create_volume), each a replication unit whose records are written as
syncs leave them: two in three primaries (control.json with outcomes and counters, a
state.json holding 20 sync reports), one in three secondaries (20 receive records, a
recovery point index of 20 points). At each size, medians of --rounds:

- a /metrics scrape (workers.metrics.Exporter.page: the units and the site's families),
  wall and CPU, and its bytes; ``cold``: the first scrape of a new exporter, which parses
  every record (as every scrape did when nothing was kept), beside ``warm``: the next ones;
- `drsvc status` of every unit: the Admin service's ListReplications, pages of 500, by the
  same servicer (cold: a new read model; warm);
- a ListVolumes page of --page entries at the start, middle and end of the id order (the
  CSI Controller servicer over the pool);
- the floor: a stat of every unit's state.json and control.json, the least a listing that
  looks at each unit's records does.
No sync runs; the machine's load average is printed beside the figures (it is shared).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def timed(fn, rounds: int) -> dict:
    walls, cpus, out = [], [], None
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return {"wall_s": round(statistics.median(walls), 4), "cpu_s": round(statistics.median(cpus), 4),
            "result": out}


def grow(site, start: int, count: int) -> list[str]:
    """*count* volumes, each a unit with the records syncs leave."""
    from drsvc.layout import PoolLayout
    from drsvc.model import MOUNT, Capability
    from drsvc.replication import common as unit_state
    from drsvc.replication.control import Control, save_control
    from drsvc.replication.points import Index, Point
    cap = [Capability(MOUNT, "SINGLE_NODE_WRITER", "ext4")]
    pool, now, out = site.pool.root, time.time(), []
    for i in range(start, start + count):
        u = site.volumes.create_volume(f"bench-{i}", required_bytes=16 * MiB, capabilities=cap).volume_id
        role = "secondary" if i % 3 == 0 else "primary"
        st = unit_state.ensure_unit(pool, u, [u], kind="volume", role=role, peer="b")
        st.generation = 40
        if role == "primary":
            for g in range(20):
                st.add_report({"generation": g, "bytes_on_wire": 170000, "duration_s": 0.03,
                               "phases": {f"phase_{k}": 0.001 for k in range(12)}})
            unit_state.save_state(pool, st)
            save_control(pool, Control(unit_id=u, kind="volume", members=[u], peer="b", interval=300,
                                       enabled_at=now - 3600, last_sync_time=now - 100, last_sync_duration=0.03,
                                       last_sync_bytes=170000, syncs_total=40, sent_bytes_total=40 * 170000,
                                       changed_bytes_total=40 * 163840))
        else:
            st.origin = {"site": "b", "interval": 300}
            for g in range(20):
                st.add_received({"generation": 21 + g, "txid": f"t{g}", "received_at": now - 300 * (20 - g),
                                 "duration_s": 0.02, "bytes": 170000, "captured_at": now - 300 * (20 - g) - 0.1})
            st.receiving_since = now - 7000
            unit_state.save_state(pool, st)
            Index(u, [Point(generation=g, time=now - 300 * (40 - g), members={u: 16 * MiB}, unique_bytes=163840)
                      for g in range(21, 41)]).save(PoolLayout(pool))
        out.append(u)
    return out


def status_all(admin, page: int = 500) -> int:
    from csi_plugin.gen import admin_pb2
    token, rows = "", 0
    while True:
        r = admin.ListReplications(admin_pb2.ListReplicationsRequest(max_entries=page, starting_token=token), None)
        rows += len(r.replications)
        if not (token := r.next_token):
            return rows


def measure(cfg, site, ids: list[str], args) -> dict:
    from csi_plugin.admin_servicer import Admin
    from csi_plugin.csi_servicers import Controller
    from csi_plugin.gen import csi_pb2
    from drsvc.controller import PoolController
    from drsvc.replication.control import ReplicationStatus
    from workers.metrics import Exporter
    ex = Exporter(cfg)
    cold = timed(lambda: len(ex.page()), 1)
    warm = timed(lambda: len(ex.page()), args.rounds)
    admin = Admin(site, None, ReplicationStatus(cfg.site, cfg.pool, site.volumes, site.groups))
    s_cold = timed(lambda: status_all(admin), 1)
    s_warm = timed(lambda: status_all(admin), args.rounds)
    ctl = Controller(PoolController(site))
    ordered = sorted(ids)
    pages = {}
    for where, token in (("start", ""), ("middle", ordered[len(ordered) // 2]), ("end", ordered[-args.page - 1])):
        pages[where] = timed(lambda token=token: len(ctl.ListVolumes(
            csi_pb2.ListVolumesRequest(max_entries=args.page, starting_token=token), None).entries), args.rounds)
    layout = site.pool.layout
    paths = [str(p) for u in ids for p in (layout.state_path(u), layout.control_path(u))]

    def stat_all():
        for p in paths:
            try:
                os.stat(p)
            except FileNotFoundError:
                pass
        return len(paths)
    cold["bytes"], warm["bytes"] = cold.pop("result"), warm.pop("result")
    return {"units": len(ids), "load_avg": os.getloadavg()[0], "scrape_cold": cold, "scrape_warm": warm,
            "status_all_cold": s_cold, "status_all_warm": s_warm,
            "list_volumes_page": pages, "floor_stat_records": timed(stat_all, args.rounds)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.listing")
    ap.add_argument("--sizes", default="500,2000")
    ap.add_argument("--page", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", default=None, help="build the pool in this new directory and keep it")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from drsvc.config import load
    from drsvc.site import Site
    sizes = [int(s) for s in args.sizes.split(",")]
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as tmp:
        root = Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        conf = root / "site.toml"
        conf.write_text(f'site = "a"\nnode_id = "n1"\npool = "{root / "pool"}"\nendpoint = "unix://{root / "s"}"\n'
                        'redis_url = "redis://127.0.0.1:1/0"\nmetrics_port = 1\n\n'
                        f'[peers.b]\ntransport = "local"\npool = "{root / "b"}"\n')
        cfg = load(conf)
        site = Site.open(cfg.pool, node_id="n1", site_id="a")
        ids, rows = [], []
        for n in sizes:
            t = time.perf_counter()
            ids += grow(site, len(ids), n - len(ids))
            print(f"# {n} units ({time.perf_counter() - t:.1f} s to grow)", flush=True)
            rows.append(measure(cfg, site, ids, args))
            if not args.json:
                print(json.dumps(rows[-1], indent=1), flush=True)
    if args.json:
        print(json.dumps({"sizes": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
