"""Recovery points: the history a unit keeps at the site that receives it.

- ``index``: the points of a unit (index.json, each point's meta.json), how a point's
  member is kept (live, undo log, whole image), building a member's image at a point,
  sealing and pinning;
- ``undo_log``: the bytes of points: packed undo logs and their maps;
- ``restore``: taking over at a point (a promote to ``drsvc.io/recoveryPoint``).

The receiver makes points as it commits (``receiver.commit_points``). May import
``common`` only: never the sender or the receiver.
"""
from __future__ import annotations

from ..common.exports import lazy_exports

_EXPORTS = {
    "Index": "index", "Point": "index", "chain": "index", "listing": "index", "select": "index",
    "layers": "index", "take_over": "restore",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
