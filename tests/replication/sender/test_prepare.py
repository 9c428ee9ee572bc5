"""A first copy's plan, written while its records leave (the pipelined prepare), and written
again from its captured images when its sender died before it was whole (``prepare.replan``).

The receiver resumes a transaction by record index and checks the indices it holds against
the sender's plan (``stream._begin``), so the plan written again must be the plan that was
being written: the same records, in the same order, with the same checksums."""
from __future__ import annotations

import os

from drsvc import store
from drsvc.replication.common.blockmap import DEFAULT_BLOCK_SIZE
from drsvc.layout import PoolLayout
from drsvc.replication.sender.prepare import prepare, replan
from drsvc.replication.common.unit_state import UnitState

from ..conftest import make_image, new_sites, write_at

MiB = 1 << 20


def _first_copy(a, members):
    layout = PoolLayout(a)
    layout.ensure_unit_dir("g")
    layout.snap_root("g").mkdir(exist_ok=True)
    st = UnitState(unit_id="g", kind="group", members=list(members))
    prepared = prepare(layout, st, members, bs=DEFAULT_BLOCK_SIZE, txid="t1", target=1,
                       base_generation=0, mode="delta", pipelined=True)
    return layout, st, prepared


def test_a_first_copy_holds_its_intent_while_it_plans_and_is_planned_again_the_same(xfs_mod):
    a, _ = new_sites(xfs_mod)
    members = ["v", "w"]
    make_image(a / "images" / "v.img", 24 * MiB, [(0, os.urandom(5 * MiB)), (9 * MiB, bytes(2 * MiB)),
                                                  (13 * MiB, os.urandom(3 * MiB))])
    make_image(a / "images" / "w.img", 8 * MiB, [(MiB, os.urandom(6 * MiB))])
    layout, st, prepared = _first_copy(a, members)
    d = layout.snap_dir("g", 1)
    assert prepared.planning is not None and prepared.dir == d          # the intent, before the plan is whole
    prepared.settle()
    meta = store.read_doc(d / "meta.json")
    assert meta["complete"] and meta["replan"] and meta["records"] > 2
    plan = (d / "plan.bin").read_bytes()
    maps = {v: (d / f"{v}.map").read_bytes() for v in members}

    # the sender died mid-plan: meta.json as the intent wrote it, part of the plan on disk
    store.write_doc(d / "meta.json", {k: v for k, v in meta.items()
                                      if k not in ("complete", "records", "changed", "scanned", "zeroed")})
    with open(d / "plan.bin", "r+b") as f:
        f.truncate(len(plan) // 3)
    write_at(a / "images" / "v.img", 0, os.urandom(MiB))        # the live image moved on meanwhile
    again = replan(layout, st)
    assert again is not None and again.dir == d and again.meta["complete"]
    assert (d / "plan.bin").read_bytes() == plan
    assert {v: (d / f"{v}.map").read_bytes() for v in members} == maps
    assert {k: again.meta[k] for k in ("txid", "records", "changed", "zeroed")} == \
        {k: meta[k] for k in ("txid", "records", "changed", "zeroed")}


def test_a_pending_plan_that_cannot_be_written_again_is_dropped(xfs_mod):
    """A captured image gone (or a base that is no longer the one it was planned against):
    the generation is dropped, which is safe since its plan was never whole, so no trailer
    left for it and the peer cannot have committed it."""
    a, _ = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", 8 * MiB, [(0, os.urandom(2 * MiB))])
    layout, st, prepared = _first_copy(a, ["v"])
    prepared.settle()
    d = layout.snap_dir("g", 1)
    meta = store.read_doc(d / "meta.json")
    store.write_doc(d / "meta.json", {k: v for k, v in meta.items() if k != "complete"})
    (d / "v.img").unlink()
    assert replan(layout, st) is None and not d.exists()
    assert replan(layout, st) is None                              # nothing pending: nothing to do
