"""Taking over as primary: the received images become the acked base.

A replica holds exactly the generation it last applied. Snapshotting it (with
block maps) as that generation's base means the new primary's first sync to
the old one ships only what changed since, never a full copy. The block maps
are the ones the receiver kept as transactions applied (``replica_maps``), so a
promote costs a reflink per member whatever the volume's size; where they do
not describe the images, the base is planned from the images, which reads every
data block.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid

from ... import store
from ...layout import PoolLayout
from ..common.replica_maps import ReplicaMaps
from ..common.unit_state import UnitState, get_state
from ..receiver.replica import recover
from ..sender.capture import capture
from ..sender.generation import Prepared
from ..sender.prepare import prepare

log = logging.getLogger(__name__)


def seed_base(pool, unit_id: str) -> str | None:
    """Record the current images as the base of the unit's current generation. Returns
    where its block maps came from ("replica maps", or "images" when they were planned
    from the images), or None when a base already exists (a repeated promote)."""
    layout = PoolLayout(pool)
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        recover(layout, unit_id)      # a committed transaction is applied first: its images are whole
        st = get_state(pool, unit_id)
        final = layout.snap_dir(unit_id, st.generation)
        if (final / "meta.json").exists():
            return None
        layout.snap_root(unit_id).mkdir(parents=True, exist_ok=True)
        txid = st.txid or uuid.uuid4().hex
        maps = ReplicaMaps(layout, unit_id)
        source = "replica maps" if maps.valid(st) else "images"
        if source == "replica maps":
            prepared = _from_maps(layout, st, maps, txid)
        else:
            log.info("%s: no block maps of the replica at generation %d; planning the base from "
                     "its images", unit_id, st.generation)
            prepared = prepare(layout, st, list(st.members), bs=st.block_size, txid=txid,
                               target=st.generation, base_generation=st.generation, mode="delta")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(prepared.dir, final)
        store.fsync_dir(final.parent)
        return source


def _from_maps(layout: PoolLayout, st: UnitState, maps: ReplicaMaps, txid: str) -> Prepared:
    """The base as ``prepare`` would plan it (reflinked images, their block maps, no
    records), with the maps the receiver kept instead of a read of every block."""
    tmp = layout.snap_tmp(st.unit_id, txid, "seed")
    shutil.rmtree(tmp, ignore_errors=True)
    t0, at = time.monotonic(), time.time()
    try:
        captured = capture(layout, list(st.members), tmp, block_size=st.block_size)
        for vol in st.members:
            maps.copy_to(vol, layout.member_map(tmp, vol))
        # a base has no records: its plan is an empty file, made durable by the directory's
        # fsync when meta.json is written (there are no bytes of it to write back)
        layout.snap_plan(tmp).touch()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sizes = {vol: os.stat(captured[vol].path).st_size for vol in st.members}
    meta = {"txid": txid, "generation": st.generation, "base_generation": st.generation, "mode": "delta",
            "members": [{"volume_id": vol, "size": sizes[vol], "base_size": sizes[vol], "fresh": False,
                         "reflinked": captured[vol].reflinked, "overlay": False} for vol in st.members],
            "records": 0, "block_size": st.block_size, "fiemap": False, "scanned": 0, "changed": 0,
            "zeroed": 0, "capture_s": time.monotonic() - t0, "plan_s": 0.0, "seeded_from": "replica maps",
            "created_at": time.time(), "captured_at": at, "complete": True}
    store.write_doc(layout.snap_meta(tmp), meta)
    return Prepared(tmp, meta)
