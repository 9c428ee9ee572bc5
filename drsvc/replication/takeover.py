"""Taking over as primary: the received images become the acked base.

A replica holds exactly the generation it last applied. Snapshotting it (with
block maps) as that generation's base means the new primary's first sync to
the old one ships only what changed since, never a full copy.
"""
from __future__ import annotations

import os
import shutil
import uuid

from .. import store
from .layout import PoolLayout
from .prepare import prepare
from .state import get_state


def seed_base(pool, unit_id: str) -> bool:
    """Record the current images as the base of the unit's current generation.

    Returns False when a base already exists (a repeated promote)."""
    layout = PoolLayout(pool)
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        st = get_state(pool, unit_id)
        final = layout.snap_dir(unit_id, st.generation)
        if (final / "meta.json").exists():
            return False
        layout.snap_root(unit_id).mkdir(parents=True, exist_ok=True)
        prepared = prepare(layout, st, list(st.members), mountpoints=(), bs=st.block_size,
                           txid=st.txid or uuid.uuid4().hex, target=st.generation,
                           base_generation=st.generation, mode="delta")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(prepared.dir, final)
        store.fsync_dir(final.parent)
        return True
