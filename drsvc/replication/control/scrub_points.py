"""A verify's check of the recovery points kept beside the replica (``scrub``'s second part).

Every kept point that is not the replica itself (``live``) keeps its members as undo logs or
whole images, each with digests recorded as they were written (``points.digests``). This
reads them back, a window at a time under the unit's lock and through the verify's read
cap, and names what differs: the point, the volume, the volume's offset and the offset in
the point's file. A member without recorded digests (kept by a release that wrote none) is
*unverifiable*, never clean.

A damaged point cannot be repaired from the primary: the primary keeps only its acked
snapshot, not the generations the points hold. The status says so, and a promote to the
point (or to an older one, whose image is built through it) is refused unless forced.
"""
from __future__ import annotations

from ..points import undo_log
from ..points.digests import PointMember
from ..points.index import Index, member_data, read_meta, undo_map
from .scrub_plan import NAMED, WINDOW_BYTES

READ_BUF = 1 << 20


class PointsCheck:
    """The points part of one verify. *scrub*: the ``Scrub`` it belongs to (its lock, its
    read cap, its notes)."""

    def __init__(self, scrub, window_bytes: int = WINDOW_BYTES):
        self.scrub, self.layout, self.unit_id = scrub, scrub.layout, scrub.unit_id
        self.window_bytes = window_bytes
        self.members = 0
        self.damaged: list = []
        self.damaged_points: set = set()
        self.bad_blocks = 0
        self.unverifiable: list = []
        self.buf = bytearray(READ_BUF)

    def run(self) -> dict:
        with self.scrub._lock():
            idx = Index.find(self.layout, self.unit_id)
            kept = [(p.generation, list(p.members), p is idx.newest) for p in (idx.points if idx else [])]
        for generation, members, newest in kept:
            for vol in members:
                self._member(generation, vol, newest)
        return {"checked_members": self.members, "damaged": self.damaged[:NAMED],
                "damaged_points": sorted(self.damaged_points), "bad_blocks": self.bad_blocks,
                "unverifiable": self.unverifiable}

    def _open(self, generation: int, vol: str, newest: bool) -> PointMember | None:
        """The member as the point keeps it now (None: the replica itself, or gone)."""
        if not self.layout.point_meta(self.unit_id, generation).exists() and not newest:
            return None
        meta = read_meta(self.layout, self.unit_id, generation)
        data = member_data(meta, vol, newest=newest)
        if data == "live":
            return None
        rows = undo_map(meta, vol)
        return PointMember(self.layout, self.unit_id, generation, vol, data, rows,
                           log_end=undo_log.log_end(rows), data_bytes=undo_log.map_bytes(rows))

    def _member(self, generation: int, vol: str, newest: bool) -> None:
        with self.scrub._lock():
            pm = self._open(generation, vol, newest)
            windows = pm.windows(self.window_bytes) if pm is not None else []
        if pm is None:
            return
        for first, count in windows:
            with self.scrub._lock():
                now = self._open(generation, vol, newest)
                if now is None or now.data != pm.data:
                    self.scrub.notes.append(f"point {generation} of {vol} changed during the verify "
                                            "(pruned or made whole): not checked further")
                    return
                try:
                    n = pm.check(first, count, self.buf)
                except FileNotFoundError:
                    return
            self.scrub.sleep(self.scrub.pacer.delay(n))
        self._gather(pm)

    def _gather(self, pm: PointMember) -> None:
        f = pm.found
        self.members += 1
        if f.unverifiable:
            self.unverifiable.append({"point": pm.generation, "volume": pm.volume_id, "data": pm.data,
                                      "bytes": f.unverifiable})
        if not f.bad_blocks:
            return
        self.bad_blocks += f.bad_blocks
        self.damaged_points.add(pm.generation)
        for off, length, at in f.bad:
            if len(self.damaged) >= NAMED:
                break
            self.damaged.append({"volume": pm.volume_id, "offset": off, "length": length, "against": "point",
                                 "generation": pm.generation, "point": pm.generation, "data": pm.data,
                                 "file_offset": at})
