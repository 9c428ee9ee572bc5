"""What both ends of a replication share.

- ``ranges``: range sets, the one interval algebra (normalize, union, subtract, intersect,
  round to blocks);
- ``extents``: the ranges of a FIEMAP extent map (data, shared physical blocks);
- ``blockmap``: per-block hash maps and zero detection;
- ``unit_state``: the unit's state document (state.json) and its role changes, on both sites;
- ``replica_maps``: the block maps of a replica, seeded by the sender when it adopts a base
  and kept by the receiver as transactions apply, so a promote reads no data;
- ``read_pacer``: a read rate cap (a verify's reads, and the primary's for it);
- ``exports``: how each room's ``__init__`` names its public surface without importing it.

Imports nothing of the engine (only drsvc's core: errors, store, layout, host).
"""
from __future__ import annotations

from .exports import lazy_exports

_EXPORTS = {
    "DIGEST": "blockmap", "hash_image": "blockmap", "hash_range": "blockmap",
    "find_state": "unit_state", "get_state": "unit_state", "set_role": "unit_state",
    "bump_epoch": "unit_state", "mark_demoted": "unit_state", "promote": "unit_state",
    "ensure_unit": "unit_state", "save_state": "unit_state",
    "data_intervals": "extents", "shared_intervals": "extents",
    "from_pairs": "ranges", "pairs": "ranges", "round_out": "ranges", "subtract": "ranges",
    "union": "ranges", "clip": "ranges", "empty": "ranges",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
