"""kill -9 while recovery points are pruned, and while a promote restores one.

Pruning runs in the receiver, at each commit: it folds the points the grid drops into
their older neighbours and copies what the generation overwrites into an undo file,
before the apply (most of that copy is made as the records arrive, ``undo_copy``: killed
there, the copies lie past the end of what the point's map names, and are made again). A
receiver killed at any of those steps (failpoints) or at random is replayed at the next
contact; afterwards every point the index lists still rebuilds to
the exact bytes the primary had at its generation, and nothing acked is lost.

A promote to a point runs in the DR site's control worker. Killed while it builds the
images or between the renames of a group's members, the task comes back (acks_late) and
the CO re-issues PromoteVolume; every member then holds the point's bytes, and every
newer point still rebuilds."""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import grpc
import pytest

from csi_plugin.gen import replication_pb2, volumegroup_pb2
from drsvc.errors import DrsvcError
from drsvc.replication import sync_unit
from drsvc.layout import PoolLayout
from drsvc.replication.points.index import Index, build_image
from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import generation, wait_for, write_random

from .steps import (MiB, Generations, check_converged, file_sha, killed_after_answer, peer_of, reissue,
                    set_receiver_failpoints, sync_now)
from .tally import TALLY, fault

PRUNE_POINTS = ("points.after_fold", "points.mid_undo", "points.before_index", "points.after_index",
                "receiver.after_apply", "receiver.after_state", "points.mid_undo_ahead")
GRIDS = ("1x1000w(keep=all)", "1x1000w(keep=3)", "1x1000w(keep=5)", "none")


def _origin(grid: str) -> dict:
    return {"site": "a", "interval": 3600, "kind": "volume", "volumes": {}, "retention": grid}


def check_points(site, unit_id, volume_ids, shas: dict) -> int:
    """Every point the index lists rebuilds to its generation's bytes; feeds the tally."""
    layout = PoolLayout(site.pool)
    idx = Index.find(layout, unit_id)
    n = 0
    with tempfile.TemporaryDirectory(dir=site.pool) as scratch:
        for p in idx.points:
            for v in volume_ids:
                out = Path(scratch) / f"{v}.img"
                build_image(layout, idx, p, v, out)
                TALLY.verified += 1
                if file_sha(out) != shas[p.generation][v]:
                    TALLY.lost += 1
                    raise AssertionError(f"point {p.generation} of {v} at {site.name} lost bytes")
                n += 1
    return n


def prune_kills(lab, rnd, rounds):
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = lab.clients["a"].create_volume(f"pk-{rnd.randrange(1 << 30)}", 16 * MiB).volume_id
    write_random(sa, vol, count=64, size=64 << 10, seed=vol)
    gens, shas = Generations(), {}

    def sync(grid, ack=None):
        """The test never writes between this record and the sync, so whatever generations
        the sync makes (a pending one finalized, then a new one) hold these bytes."""
        sha, before = gens.record(sa, vol), generation(sa, vol)
        try:
            with peer_of(sa) as p:
                p.ack = ack or p.ack
                sync_unit(sa.pool, vol, [vol], p, origin=_origin(grid))
        finally:
            for g in range(before + 1, max(generation(sa, vol), before + 1) + 1):   # killed: pending
                shas.setdefault(g, {vol: sha})

    sync(GRIDS[0])
    killed: Counter = Counter()
    for i in range(rounds):
        point = PRUNE_POINTS[i % len(PRUNE_POINTS)] if i < 2 * len(PRUNE_POINTS) else rnd.choice(PRUNE_POINTS)
        # a fold needs points to drop; an undo needs a point to keep the bytes (the copy made
        # as the records arrive, mid_undo_ahead: the grid keeps the newest point)
        grid = {"points.after_fold": "1x1000w(keep=2)", "points.mid_undo": rnd.choice(GRIDS[:3]),
                "points.mid_undo_ahead": GRIDS[0]}.get(point, rnd.choice(GRIDS))
        if point == "points.after_fold":
            # keep=2 keeps the bucket's two oldest and the newest: with three points before this
            # sync, at least one between them is dropped and folded into an older one
            for _ in range(3):
                write_random(sa, vol, count=4, seed=rnd.random())
                sync(GRIDS[0])
        write_random(sa, vol, count=rnd.randint(1, 24), size=rnd.choice([4096, 64 << 10, 256 << 10]),
                     seed=rnd.random())
        set_receiver_failpoints(lab, "b", [point])
        try:
            try:
                # the undo copy made as the records arrive serves a peer that answers once
                # applied; one acking at its commit marker copies after its answer
                sync(grid, ack="applied" if point == "points.mid_undo_ahead" else None)
                # a peer acking at its commit marker prunes after its answer: killed there, the
                # sync is acked and the committed journal waits for the next contact
                hit = killed_after_answer(sb, vol)
            except DrsvcError:
                hit = True
            if hit:
                killed[point] += 1
                fault()
                set_receiver_failpoints(lab, "b", ())
                sync(grid)                      # the next contact replays, then the sync finishes
        finally:
            set_receiver_failpoints(lab, "b", ())
        check_converged(sa, sb, vol, [vol])
        gens.check_whole(sb, vol)
        assert check_points(sb, vol, [vol], shas) >= 1
        if i % 3 == 2:                          # and some rounds without a kill, to build up points
            write_random(sa, vol, count=8, seed=rnd.random())
            sync(GRIDS[0])
    assert set(killed) == set(PRUNE_POINTS), killed
    return vol


def _group(lab, name, n=3):
    A = lab.clients["a"]
    g = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name=name)).volume_group
    vids = [A.create_volume(f"{name}-{i}", 16 * MiB, volumeGroup=g.volume_group_id).volume_id for i in range(n)]
    return g.volume_group_id, vids


def promote(client, gid, point: str, force=True):
    req = replication_pb2.PromoteVolumeRequest(force=force, parameters={"drsvc.io/recoveryPoint": point})
    req.replication_source.volumegroup.volume_group_id = gid
    return client.repl.PromoteVolume(req, timeout=60)


class _Latest(dict):
    """Generation -> the members' sha256. A generation not recorded holds the bytes of the
    newest one recorded before it: the test writes only before it records a generation, and a
    sync_now whose first answer came too late under load may have run once more, with
    nothing new to send but a generation of its own."""

    def __missing__(self, generation):
        return self[max(g for g in self if g < generation)]


def promote_kill(lab, rnd, failpoint):
    """A group synced a few times; b's control worker dies at *failpoint* while it restores
    an older point; the CO's retry converges on the point's bytes, nothing else lost."""
    A = lab.clients["a"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    gid, vids = _group(lab, f"prk-{rnd.randrange(1 << 30)}")
    for v in vids:
        write_random(sa, v, count=32, size=64 << 10, seed=v)
    shas = _Latest({1: {v: file_sha(sa.pool / "images" / f"{v}.img") for v in vids}})
    A.retry("EnableVolumeReplication", group_id=gid, parameters={"schedulingInterval": "1h"})
    wait_for(lambda: generation(sa, gid) >= 1, 60, what="initial sync")
    for _ in range(4):
        for v in vids:
            write_random(sa, v, count=rnd.randint(1, 16), seed=rnd.random())
        target = generation(sa, gid) + 1
        shas[target] = {v: file_sha(sa.pool / "images" / f"{v}.img") for v in vids}
        reissue(lambda: sync_now(A, gid, 60), what="sync")
        # a reissued SyncNow may have run once more: an idle generation (_Latest)
        assert generation(sa, gid) >= target
    idx = Index.find(PoolLayout(sb.pool), gid)
    older = [p.generation for p in idx.points if p.generation in shas][:-1]
    chosen = rnd.choice(older)
    run = sb.run
    run.stop("worker")                        # the control worker alone takes the promote
    run.stop("control")
    run.start("control", extra_env={"DRSVC_FAILPOINTS": failpoint})
    staging = [PoolLayout(sb.pool).restore_staging(v) for v in vids]
    try:
        try:
            promote(lab.clients["b"], gid, str(chosen))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED), e
        wait_for(lambda: any(p.exists() for p in staging), 60, interval=0.05, what="the worker to die mid-restore")
        fault()
    finally:
        run.stop("control")
        run.start("control")
    assert find_state(sb.pool, gid).role == "secondary"     # killed before it took over
    reissue(lambda: promote(lab.clients["b"], gid, str(chosen)), timeout=180, what="PromoteVolume again")
    st = find_state(sb.pool, gid)
    assert st.role == "primary"
    for v in vids:
        TALLY.verified += 1
        if file_sha(sb.pool / "images" / f"{v}.img") != shas[chosen][v]:
            TALLY.torn += 1
            raise AssertionError(f"{v} at b does not hold point {chosen}")
    assert not [p for p in staging if p.exists()]
    # the newer points are still there, pinned, and rebuild to their bytes
    idx = Index.find(PoolLayout(sb.pool), gid)
    newer = [p for p in idx.points if p.generation > chosen]
    assert newer and all(p.pin_until for p in newer)
    check_points(sb, gid, vids, shas)


@pytest.mark.faults
def test_receiver_killed_while_pruning(flab, rnd):
    prune_kills(flab, rnd, 16)


@pytest.mark.faults
@pytest.mark.parametrize("failpoint", ["points.mid_restore", "points.mid_rename"])
def test_control_worker_killed_during_promote_to_a_point(flab, rnd, failpoint):
    promote_kill(flab, rnd, failpoint)


@pytest.mark.soak
def test_soak_receiver_killed_while_pruning(flab, rnd):
    prune_kills(flab, rnd, 100)
