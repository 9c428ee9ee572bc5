"""Taking over at a recovery point: what a promote does to the points of a secondary.

Every promote seals the newest point (its members get whole images of their own, by
reflink), because the replica is about to be written by its users and the older points
are kept as differences from it. A promote to an older point (``drsvc.io/recoveryPoint``)
then builds each member's image at that point beside the replica (a reflink of the
newest point's image with the undo files of the points in between laid over it: the
cost follows the bytes changed since the point, not the volume's size) and renames it
over the replica, every member before the unit changes role. The points newer than the
chosen one stay, pinned for a day, so the writes made after it can still be cloned and
inspected.

Repeat-safe: the images are built from the points' files, which the restore does not
change, so a promote killed half way and run again ends the same.
"""
from __future__ import annotations

import logging
import os

from ... import store
from ...errors import PointNotFound, PointNotRestorable
from ...failpoints import failpoint
from ...layout import PoolLayout
from ..common.unit_state import get_state
from .index import PIN_NEWER, Index, build_image, pin_newer, seal

log = logging.getLogger(__name__)


def take_over(pool, unit_id: str, generation: int | None = None, *, pin: float = PIN_NEWER) -> int | None:
    """Seal the newest point and, with *generation*, make that point the data of every
    member. Returns the generation restored (None: the replica as it is)."""
    layout = PoolLayout(pool)
    with store.file_lock(layout.lock_path(unit_id), blocking=True, key=unit_id):
        idx = Index.find(layout, unit_id)
        if idx is None or not idx.points:
            if generation is not None:
                raise PointNotFound(unit_id=unit_id, point=f"at generation {generation}")
            return None
        seal(layout, idx)
        if generation is None:
            return None
        point = idx.get(generation)
        if point is None:
            raise PointNotFound(unit_id=unit_id, point=f"at generation {generation}")
        members = get_state(pool, unit_id).members
        late = [v for v in members if v not in point.members]
        if late:
            raise PointNotRestorable(unit_id=unit_id, generation=generation,
                                     reason=f"{', '.join(late)} joined the unit after it")
        if point is not idx.newest:
            _restore(layout, idx, point, members)
        pin_newer(layout, idx, generation, pin)
        log.info("unit %s: generation %d restored from its recovery point (%s); %d newer point(s) pinned",
                 unit_id, generation, point.rfc3339, sum(p.generation > generation for p in idx.points))
        return generation


def _restore(layout: PoolLayout, idx: Index, point, members) -> None:
    staged = {}
    for vol in members:
        dest = layout.restore_staging(vol)
        build_image(layout, idx, point, vol, dest)
        size = os.path.getsize(layout.image(vol))
        if os.path.getsize(dest) < size:          # a volume only grows: keep its capacity
            os.truncate(dest, size)
        staged[vol] = dest
    failpoint("points.mid_restore")
    for vol, dest in staged.items():
        os.replace(dest, layout.image(vol))
        failpoint("points.mid_rename")
    store.fsync_dir(layout.images)
