"""Recovery points under load: `python -m bench.points [--json]`.

Two volumes of --size-mib MiB on a loop XFS at site a, replicated over a loopback sshd
(the forced receiver) into a second loop XFS: unit R keeps points by --grid, unit N by
the grid "none" (the newest point only: nothing is copied, nothing pruned) - the peer
figure, measured in the same run. Before each sync --change of each volume is rewritten
(4 KiB blocks at random places); the two units are synced back to back, one pair every
--interval seconds (or at once when a pair takes longer), for --duration s. The order
alternates, R first in one pair and N first in the next: the first sync of a pair runs
slower here whatever it carries (two units both kept with the grid "none", 30 pairs: 1.09x
with the same one always first, 0.975x with the other), and a fixed order would count that
against or for retention.
It reports:

* the points R keeps at the end, and the receiver's cost per commit for them (the plan,
  the folds of pruned points and their removal: ``prune``; the copy of what a
  generation overwrites: ``undo``; the index write), from ``points/costs.json``;
* the DR pool's bytes (statvfs of b's filesystem, less what it held empty) against the
  replicas plus the points' unique bytes (goal <= 1.05x);
* sync time of R against N, medians (goal <= 1.1x), with the receiver's phases;
* listing at --list-points points (goal < 1 s), and the pruning cost per sync at that
  many (goal <= 20 ms): a small volume synced that many times with a keep-all grid, then
  synced with a grid that drops one point a sync;
* promote to a point (drsvc.replication.points.restore.take_over: seal the newest point,
  build the chosen one's images, rename them in) for volumes of --promote-mib MiB: to the
  point before a sync that changed --promote-fixed-mib, then one and three syncs of
  --change further back, with the bytes changed since each. Before the restores comes what
  every promote does first, ``seed_base_s``: the replica becomes the acked base of the new
  primary, with the block maps the receiver kept (``seed_source``); ``seed_read_s`` beside
  it is the same base planned from the images instead (it reads every data block: what a
  promote costs where the receiver keeps no maps, measured in the same run). ``promote_s`` =
  seed + restore (goal < 1 s). The restore's floor is ``floor_s``: as many FICLONERANGE
  calls of 4 KiB as the restore laid ranges (``ranges_laid``), into a reflink of the same
  image, timed in the same run.
The load average is printed beside the figures (this VM is shared)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from drsvc.layout import PoolLayout

from .harness import MiB, rewrite_blocks, write_random
from .site import loop_mounted_xfs, sshd_site

GRID = "1x10s(keep=all) | 24x10s | 14x60s"


def origin(grid: str) -> dict:
    return {"site": "a", "interval": 1, "kind": "volume", "volumes": {}, "retention": grid}


def fs_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def med(xs) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


class Pair:
    """Site a's pool, site b's pool behind a loopback sshd, and a warm SSH peer."""

    def __init__(self, a: Path, b: Path, site):
        from drsvc.transport.ssh import SshPeer
        self.a, self.b, self.site = a, b, site
        for p in (a, b):
            (p / "images").mkdir(parents=True, exist_ok=True)
        self.peer = SshPeer("127.0.0.1", port=site.port, key_file=site.client_key, known_hosts=site.known_hosts)

    def image(self, unit: str) -> Path:
        return self.a / "images" / f"{unit}.img"

    def sync(self, unit: str, grid: str) -> dict:
        """One sync, timed to its return; then, untimed, the peer's apply that a durable ack
        leaves behind the answer (its point and its costs are read next)."""
        from drsvc.replication import sync_unit
        from drsvc.replication.receiver import wait_for_apply
        t = time.monotonic()
        try:
            rep = sync_unit(self.a, unit, [unit], self.peer, origin=origin(grid))
        finally:
            self.peer.close()                 # as a job does; the login stays cached
        wall = time.monotonic() - t
        wait_for_apply(PoolLayout(self.b), unit)
        return {"wall_s": wall, "report": rep.to_dict()}

    def costs(self, unit: str) -> dict:
        return json.loads(PoolLayout(self.b).points_costs(unit).read_text())

    def listing(self, unit: str):
        from drsvc.replication.points import listing
        return listing(PoolLayout(self.b), unit)


def run_load(pair: Pair, args, rnd) -> dict:
    """The 10-minute part: R and N synced back to back (in turns first), a pair every --interval s."""
    size = args.size_mib * MiB
    for unit in ("R", "N"):
        write_random(pair.image(unit), size, rnd)
    base = fs_used(pair.b)
    pair.sync("R", args.grid)
    pair.sync("N", "none")
    walls = {"R": [], "N": []}
    phases = {"R": [], "N": []}
    costs = []
    t_end = time.monotonic() + args.duration
    pair_order = [("R", args.grid), ("N", "none")]
    while time.monotonic() < t_end:
        t0 = time.monotonic()
        for unit, grid in pair_order:
            rewrite_blocks(pair.image(unit), args.change, rnd)
            out = pair.sync(unit, grid)
            walls[unit].append(out["wall_s"])
            phases[unit].append(out["report"]["phases"])
        costs.append(pair.costs("R"))
        pair_order.reverse()
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    pts, space = pair.listing("R")
    _, space_n = pair.listing("N")
    used = fs_used(pair.b) - base
    expected = space.total + space_n.total
    return {
        "syncs": len(walls["R"]), "points_kept": len(pts),
        "sync_s": {"with_retention": med(walls["R"]), "without_retention": med(walls["N"]),
                   "ratio": round(med(walls["R"]) / med(walls["N"]), 3) if walls["N"] else None},
        "peer_phases_s": {u: {k: med([p.get(k, 0.0) for p in phases[u]]) for k in ("peer_sync_s", "peer_apply_s",
                                                                                    "stream_s", "prepare_s")}
                          for u in phases},
        "points_cost_s": {k: {"median": med([c[k] for c in costs]), "max": round(max(c[k] for c in costs), 4)}
                          for k in ("prune_s", "fold_s", "remove_s", "undo_s", "index_s")} if costs else {},
        "pruned_per_sync": round(sum(c["pruned"] for c in costs) / max(1, len(costs)), 2),
        "space": {"dr_pool_bytes": used, "replicas_plus_unique_bytes": expected,
                  "replica_bytes": space.replica_bytes + space_n.replica_bytes,
                  "points_unique_bytes": space.points_bytes,
                  "ratio": round(used / expected, 4) if expected else None},
    }


def run_many(pair: Pair, args, rnd) -> dict:
    """--list-points points of a small volume; the listing, then a sync that drops one."""
    unit = "M"
    img = pair.image(unit)
    write_random(img, 4 * MiB, rnd)
    keep_all = "1x1000w(keep=all)"
    for _ in range(args.list_points):
        rewrite_blocks(img, 0, rnd, count=4)
        pair.sync(unit, keep_all)
    times = []
    for _ in range(5):
        t = time.monotonic()
        pts, _ = pair.listing(unit)
        times.append(time.monotonic() - t)
    n = len(pts)
    drop_one = f"1x1000w(keep={max(1, n - 1)})"     # the n-1 oldest and the newest: one goes a sync
    prune, index = [], []
    for _ in range(args.prune_syncs):
        rewrite_blocks(img, 0, rnd, count=4)
        pair.sync(unit, drop_one)
        c = pair.costs(unit)
        prune.append(c["prune_s"])
        index.append(c["index_s"])
    return {"points": n, "list_s": {"median": med(times), "max": round(max(times), 4)},
            "prune_s_per_sync": {"median": med(prune), "max": round(max(prune), 4) if prune else None},
            "index_write_s": med(index), "pruned_per_sync": pair.costs(unit)["pruned"]}


def run_promote(pair: Pair, args, rnd) -> dict:
    """Promote to a point (the restore step: seal, build, rename) of a volume of each
    --promote-mib size, after --promote-syncs syncs of --change each and a last one of
    --promote-fixed-mib: to the point before that last sync (the same bytes changed since,
    whatever the size), then one and three syncs of --change further back. Each restore
    chains from the newest point's image, sealed by the first."""
    from drsvc.host.reflink import clone_file
    from drsvc.replication.points import take_over
    from drsvc.replication.control import seed_base

    from .harness import same_content
    out = {}
    for mib in args.promote_mib:
        unit = f"P{mib}"
        img = pair.image(unit)
        write_random(img, mib * MiB, rnd)
        gens, expect, changed = [pair.sync(unit, "1x1000w(keep=all)")["report"]["target_generation"]], {}, []
        for i in range(args.promote_syncs + 1):
            if mib <= 2048:                   # what each generation holds, to check the restores
                expect[gens[-1]] = pair.a / f"expect-{unit}-{i}.img"
                clone_file(img, expect[gens[-1]])
            last = i == args.promote_syncs
            offs = rewrite_blocks(img, 0 if last else args.change, rnd,
                                  count=args.promote_fixed_mib * MiB // 4096 if last else None)
            changed.append(len(offs) * 4096)
            gens.append(pair.sync(unit, "1x1000w(keep=all)")["report"]["target_generation"])
        read_s = _unit_free(lambda unit=unit: _seed_read(pair.b, unit))      # first: no base yet
        seeded = {}
        seed_s = _unit_free(lambda unit=unit, seeded=seeded: seeded.update(source=seed_base(pair.b, unit)))
        for back in (1, 2, 4):
            target = gens[-1 - back]
            ranges = _ranges_to_lay(pair.b, unit, target)
            t = time.monotonic()
            take_over(pair.b, unit, target)
            dt = time.monotonic() - t
            ok = same_content(expect[target], pair.b / "images" / f"{unit}.img") if target in expect else None
            out[f"{mib}MiB_back{back}"] = {"promote_s": round(seed_s + dt, 4), "restore_s": round(dt, 4),
                                          "seed_base_s": round(seed_s, 4), "seed_source": seeded["source"],
                                          "seed_read_s": round(read_s, 4), "generation": target,
                                          "bytes_changed_since": sum(changed[-back:]), "verified": ok,
                                          "ranges_laid": ranges}
        for back in (1, 2, 4):        # after the restores: its clone and deletion would slow them
            v = out[f"{mib}MiB_back{back}"]
            v["floor_s"] = round(_lay_floor(pair.b, unit, v["ranges_laid"], rnd), 4)
        for f in expect.values():
            f.unlink()
        (pair.b / "images" / f"{unit}.img").unlink()           # room for the next size
    return out


def _seed_read(pool: Path, unit: str) -> float:
    """The promote's base planned from the images (every data block read and hashed), into a
    scratch directory: what ``seed_base`` costs where the replica's maps are not kept."""
    import shutil
    import uuid

    from drsvc.replication.sender import prepare_generation as prepare
    from drsvc.replication.common import get_state
    layout, st = PoolLayout(pool), get_state(pool, unit)
    t = time.monotonic()
    prepared = prepare(layout, st, list(st.members), bs=st.block_size, txid=uuid.uuid4().hex,
                       target=st.generation, base_generation=st.generation, mode="delta")
    dt = time.monotonic() - t
    shutil.rmtree(prepared.dir)
    os.sync()      # its image's reflinked extents are freed now, not during what is timed next
    return dt


def _ranges_to_lay(pool: Path, unit: str, target: int) -> int:
    """The ranges a restore to *target* lays (as ``index.build_image`` picks them)."""
    from drsvc.replication.points import Index, chain, layers
    layout = PoolLayout(pool)
    idx = Index.find(layout, unit)
    _, overlays = chain(layout, idx, idx.get(target), unit)
    return sum(len(m) for _log, m in layers(overlays))


def _lay_floor(pool: Path, unit: str, n: int, rnd) -> float:
    """*n* FICLONERANGE calls of 4 KiB from a scratch log into a reflink of the replica, at
    random places, in offset order, and the fsync: the kernel's share of a restore."""
    from drsvc.host.reflink import clone_file, clone_file_range
    img = pool / "images" / f"{unit}.img"
    dst, log = pool / "images" / f".{unit}.floor", pool / "images" / f".{unit}.floorlog"
    size = os.path.getsize(img)
    with open(log, "wb") as f:
        f.write(os.urandom(max(n, 1) * 4096))
        os.fsync(f.fileno())
    clone_file(img, dst)
    offs = sorted(rnd.sample(range(size // 4096), n))
    src_fd, dst_fd = os.open(log, os.O_RDONLY), os.open(dst, os.O_RDWR)
    try:
        t = time.monotonic()
        for i, b in enumerate(offs):
            clone_file_range(src_fd, i * 4096, dst_fd, b * 4096, 4096)
        os.fsync(dst_fd)
        return time.monotonic() - t
    finally:
        os.close(src_fd)
        os.close(dst_fd)
        dst.unlink()
        log.unlink()
        os.sync()      # XFS frees a deleted reflink's extents in the background: not during the next restore


def _unit_free(fn) -> float:
    """Run *fn* once the receiver that served the last sync has let the unit go (it does
    so as its session ends, a moment after the sender's sync returned); its duration."""
    from drsvc.errors import OperationInProgress
    deadline = time.monotonic() + 30
    while True:
        t = time.monotonic()
        try:
            fn()
            return time.monotonic() - t
        except OperationInProgress:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def goals(r: dict) -> list[str]:
    lines = []

    def judge(name, value, limit, unit=""):
        if value is None:
            return
        lines.append(f"{'PASS' if value <= limit else 'MISS'}  {name}: {value}{unit} (goal <= {limit}{unit})")
    judge("sync time with / without retention", r["load"]["sync_s"]["ratio"], 1.1, "x")
    judge("DR pool bytes / (replicas + unique bytes)", r["load"]["space"]["ratio"], 1.05, "x")
    judge(f"listing at {r['many']['points']} points", r["many"]["list_s"]["median"], 1.0, " s")
    judge(f"pruning per sync at {r['many']['points']} points", r["many"]["prune_s_per_sync"]["median"], 0.020, " s")
    judge("pruning per sync under load (median)", r["load"]["points_cost_s"].get("prune_s", {}).get("median"),
          0.020, " s")
    for k, v in r["promote"].items():
        judge(f"promote to a point, {k} ({v['bytes_changed_since'] >> 20} MiB changed since; restore floor "
              f"{v['floor_s']} s for its {v['ranges_laid']} ranges; base from the {v['seed_source']})",
              v["promote_s"], 1.0, " s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.points", description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--change", type=float, default=0.01, help="fraction rewritten before each sync")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of syncs")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between syncs of R")
    ap.add_argument("--grid", default=GRID)
    ap.add_argument("--list-points", type=int, default=1000)
    ap.add_argument("--prune-syncs", type=int, default=10)
    ap.add_argument("--promote-mib", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 10240])
    ap.add_argument("--promote-syncs", type=int, default=4)
    ap.add_argument("--promote-fixed-mib", type=int, default=8, help="changed by the last sync before the restores")
    ap.add_argument("--fs-size", default="60G")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    load0 = os.getloadavg()
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(loop_mounted_xfs(args.fs_size))
        b = stack.enter_context(loop_mounted_xfs(args.fs_size))
        site = stack.enter_context(sshd_site(b))
        pair = Pair(a, b, site)
        t0 = time.monotonic()
        r = {"load": run_load(pair, args, rnd)}
        r["many"] = run_many(pair, args, rnd)
        r["promote"] = run_promote(pair, args, rnd)
        r["wall_s"] = round(time.monotonic() - t0, 1)
    r["params"] = {k: v for k, v in vars(args).items() if k != "json"}
    r["loadavg"] = {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]}
    r["goals"] = goals(r)
    if not args.json:
        print(json.dumps(r, indent=1))
    for line in r["goals"]:
        print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        sys.exit(main())
