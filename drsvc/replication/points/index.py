"""Recovery points: the history a replication unit keeps at the site that receives it.

Every generation the receiver commits is a point (drsvc.replication.receiver.commit_points makes
them). Where they live (PoolLayout)::

    replication/<unit>/points/index.json        every point of the unit, one document
    replication/<unit>/points/<gen>/meta.json   per member: how the point's bytes are kept
    replication/<unit>/points/<gen>/<vol>.undo  ...the bytes later generations overwrote
    replication/<unit>/points/<gen>/<vol>.img   ...or a whole image (reflink)
    replication/<unit>/points/<gen>/<vol>.undo.sums, <vol>.img.map   their digests (points.digests)

A member of a point is kept one of three ways:

* ``live``: the newest point of a secondary is the replica itself; it costs nothing.
* ``undo``: the point equals the next newer point except on its *covered* ranges, where
  its undo file holds what the later generation overwrote (drsvc.replication.points.undo_log).
* ``full``: a whole image, shared by reflink. A promote seals the newest point this way
  (the replica is about to be written by its users), and a point whose newer neighbour
  is pruned away while full becomes full itself.

So an image of any point is the nearest newer ``full`` image (or the live replica) with
the undo files of the points in between laid over it, oldest first.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ... import store
from ...errors import CorruptMetadata, InvalidParameter, PointNotFound, PointNotRestorable
from ...host.fiemap import FIEMAP_EXTENT_SHARED, fiemap_array
from ...host.reflink import clone_file
from ...layout import PoolLayout
from ..common import ranges
from . import digests, undo_log

LIVE, UNDO, FULL = "live", "undo", "full"
SCHEDULED = "scheduled"
PIN_NEWER = 24 * 3600.0          # a promote to a point pins the newer points this long


@dataclass
class Point:
    generation: int
    time: float                   # the origin's capture instant (a CSI snapshot's creation time)
    kind: str = SCHEDULED         # scheduled | snapshot:<id> | group-snapshot:<id>
    txid: str | None = None
    received_at: float = 0.0
    pinned: bool = False          # for good: a replicated CSI snapshot, until the origin deletes it
    pin_until: float | None = None
    members: dict = field(default_factory=dict)     # volume id -> size at this generation
    unique_bytes: int = 0         # bytes kept for this point alone (its undo files)
    cut: dict | None = None       # a group's: the round and the members captured together
    snapshot: dict | None = None  # the CSI snapshot it replicates: id, name, group, members {vol: sid}

    def is_pinned(self, now: float) -> bool:
        return self.pinned or (self.pin_until or 0.0) > now

    @property
    def total_bytes(self) -> int:
        return sum(int(v) for v in self.members.values())

    @property
    def rfc3339(self) -> str:
        return rfc3339(self.time)

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> Point:
        try:
            return cls(**doc)             # as this release writes it: every key a field
        except TypeError:                 # keys of another release: the known ones
            return cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Index:
    unit_id: str
    points: list = field(default_factory=list)      # Point, oldest generation first
    grid: str = ""

    @classmethod
    def find(cls, layout: PoolLayout, unit_id: str) -> Index | None:
        path = layout.points_index(unit_id)
        doc = store.read_doc(path)
        if doc is None:
            return None
        try:
            pts = sorted((Point.from_doc(p) for p in doc.get("points", [])), key=lambda p: p.generation)
        except TypeError as e:
            raise CorruptMetadata(path=str(path), reason=str(e)) from None
        return cls(unit_id, pts, doc.get("grid", ""))

    @classmethod
    def load(cls, layout: PoolLayout, unit_id: str) -> Index:
        return cls.find(layout, unit_id) or cls(unit_id)

    def save(self, layout: PoolLayout) -> None:
        layout.points_dir(self.unit_id).mkdir(parents=True, exist_ok=True)
        doc = {"schema": store.SCHEMA_VERSION, "unit": self.unit_id, "grid": self.grid,
               "points": [p.to_doc() for p in self.points]}
        # one compact document: 1,000 points read and written in milliseconds
        store.atomic_write_bytes(layout.points_index(self.unit_id), json.dumps(doc, separators=(",", ":")).encode())

    def get(self, generation: int) -> Point | None:
        for p in self.points:
            if p.generation == generation:
                return p
        return None

    @property
    def newest(self) -> Point | None:
        return self.points[-1] if self.points else None

    def has_txid(self, txid: str) -> bool:
        return any(p.txid == txid for p in reversed(self.points))


# -- a point's members: how their bytes are kept ----------------------------------------
def read_meta(layout: PoolLayout, unit_id: str, generation: int) -> dict:
    return store.read_doc(layout.point_meta(unit_id, generation)) or {"generation": generation, "members": {}}


def ensure_point_dir(layout: PoolLayout, unit_id: str, generation: int) -> Path:
    d = layout.point_dir(unit_id, generation)
    if not d.exists():
        d.mkdir(parents=True, exist_ok=True)
        store.fsync_dir(d.parent)
    return d


def write_meta(layout: PoolLayout, unit_id: str, meta: dict) -> None:
    d = ensure_point_dir(layout, unit_id, meta["generation"])
    store.atomic_write_bytes(d / "meta.json", json.dumps({**meta, "schema": store.SCHEMA_VERSION},
                                                         separators=(",", ":")).encode())


def member_data(meta: dict, volume_id: str, *, newest: bool = True) -> str:
    """live, undo or full. A member with no record is the replica itself in the newest
    point, and an empty undo (the same bytes as the next point) in any older one."""
    return (meta["members"].get(volume_id) or {}).get("data", LIVE if newest else UNDO)


def undo_map(meta: dict, volume_id: str):
    """Where the member's undo log keeps each range (undo_log): (offset, length, position) rows."""
    return undo_log.decode_map((meta["members"].get(volume_id) or {}).get("map"))


# -- reading a point --------------------------------------------------------------------
RECOVERY_POINT = "drsvc.io/recoveryPoint"


def parse_spec(text: str, key: str = RECOVERY_POINT) -> tuple[int | float, bool]:
    """A point named by its generation ("42") or by a time, RFC 3339 ("2026-11-22T23:17:56Z":
    the newest point at or before it). Returns (value, by_time)."""
    text = (text or "").strip()
    if text.isascii() and text.isdigit():
        return int(text), False
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidParameter(key=key, reason=f"{text[:64]!r} is neither a generation number nor an "
                                               "RFC 3339 time") from None
    if dt.tzinfo is None:
        raise InvalidParameter(key=key, reason=f"{text[:64]!r} has no time zone (RFC 3339: add Z or +hh:mm)")
    return dt.timestamp(), True


def find_point(layout: PoolLayout, unit_id: str, text: str, key: str = RECOVERY_POINT) -> Point:
    """The unit's point *text* names, or PointNotFound / InvalidParameter."""
    value, by_time = parse_spec(text, key)
    idx = Index.find(layout, unit_id)
    if idx is None:
        raise PointNotFound(unit_id=unit_id, point=text[:64])
    return select(idx, value, by_time=by_time)


def select(idx: Index, spec: int | float, *, by_time: bool) -> Point:
    """The point of a generation, or the newest point at or before a time."""
    if by_time:
        found = [p for p in idx.points if p.time <= spec]
        if found:
            return max(found, key=lambda p: (p.time, p.generation))
        raise PointNotFound(unit_id=idx.unit_id, point=f"at or before {rfc3339(spec)}")
    p = idx.get(int(spec))
    if p is None:
        raise PointNotFound(unit_id=idx.unit_id, point=f"at generation {int(spec)}")
    return p


def chain(layout: PoolLayout, idx: Index, point: Point, volume_id: str) -> tuple[Path, list]:
    """What an image of *volume_id* at *point* is made of: a base file (a full image, or
    the live replica) and, oldest first, the (undo log, map) pairs laid over it."""
    overlays: list = []
    for p in idx.points:
        if p.generation < point.generation:
            continue
        if volume_id not in p.members:
            break
        meta = read_meta(layout, idx.unit_id, p.generation)
        kind = member_data(meta, volume_id, newest=p is idx.newest)
        if kind == FULL:
            return layout.point_image(idx.unit_id, p.generation, volume_id), overlays
        if kind == LIVE:
            return layout.image(volume_id), overlays
        overlays.append((layout.point_undo(idx.unit_id, p.generation, volume_id), undo_map(meta, volume_id)))
    raise PointNotRestorable(unit_id=idx.unit_id, generation=point.generation,
                             reason=f"the history of {volume_id} after it is incomplete")


def layers(overlays):
    """(log, map rows) to lay over a member's base, oldest first (*overlays*: ``chain``'s):
    of each undo, the ranges no newer one laid already."""
    laid = ranges.empty()
    for log, m in overlays:
        want = ranges.subtract(undo_log.covered(m), laid)
        if len(want[0]):
            yield log, undo_log.clip(m, want)
            laid = ranges.union(laid, want)


def build_image(layout: PoolLayout, idx: Index, point: Point, volume_id: str, dest: Path) -> None:
    """Write the image of *volume_id* at *point* to the new file *dest* (durably, its size the
    point's): a reflink of its base, then each undo's ranges not laid already, oldest first."""
    base, overlays = chain(layout, idx, point, volume_id)
    dest.unlink(missing_ok=True)
    clone_file(base, dest, fsync=False)
    fd = os.open(dest, os.O_RDWR)
    try:
        os.ftruncate(fd, max(int(point.members[volume_id]), os.fstat(fd).st_size))
        for log, m in layers(overlays):
            undo_log.lay(fd, log, m)
        os.ftruncate(fd, int(point.members[volume_id]))
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(layout: PoolLayout, idx: Index, volumes=None) -> bool:
    """Give the live members of the newest point (or only *volumes* of them) a whole image
    of their own, so the replica may be written; True when one was made. Repeat-safe."""
    point = idx.newest
    if point is None:
        return False
    meta = read_meta(layout, idx.unit_id, point.generation)
    made = False
    for vol in point.members:
        if member_data(meta, vol) != LIVE or (volumes is not None and vol not in volumes):
            continue
        final = layout.point_image(idx.unit_id, point.generation, vol)
        ensure_point_dir(layout, idx.unit_id, point.generation)
        tmp = layout.staging_image(final)
        tmp.unlink(missing_ok=True)
        clone_file(layout.image(vol), tmp)
        os.replace(tmp, final)
        digests.record_sealed(layout, idx.unit_id, point.generation, vol)
        meta["members"][vol] = {"data": FULL, "map": "", "bytes": 0}
        made = True
    if made:
        store.fsync_dir(layout.point_dir(idx.unit_id, point.generation))
        write_meta(layout, idx.unit_id, meta)
    return made


# -- what the pool holds for them -------------------------------------------------------
def unshared_bytes(path: Path) -> int:
    """Bytes of a whole image that no other file shares (FIEMAP, not flagged shared)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        ext = fiemap_array(fd, os.fstat(fd).st_size)
        return int(ext["length"][(ext["flags"] & FIEMAP_EXTENT_SHARED) == 0].sum()) if len(ext) else 0
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Space:
    replica_bytes: int            # the live replica's allocated bytes
    points_bytes: int             # the bytes kept for the points alone (the sum of their unique bytes)

    @property
    def total(self) -> int:
        """What the unit takes at this site: the replica plus its points."""
        return self.replica_bytes + self.points_bytes


def listing(layout: PoolLayout, unit_id: str, members=()) -> tuple[list[Point], Space]:
    """The points of a unit, oldest first, with their unique bytes, and the space they take.
    One read of the index; a point's undo bytes are counted as they are written (cached in
    the index), whole images (a promote's seal) are measured with FIEMAP."""
    idx = Index.find(layout, unit_id)
    pts = idx.points if idx else []
    for p in pts:
        for v in p.members:
            p.unique_bytes += unshared_bytes(layout.point_image(unit_id, p.generation, v))
    vols = list(members) or (list(pts[-1].members) if pts else [])
    replica = sum(allocated_bytes(layout.image(v)) for v in vols)
    return pts, Space(replica, sum(p.unique_bytes for p in pts))


def whole_images(layout: PoolLayout, unit_id: str, pts) -> list[Path]:
    """The whole images the points *pts* hold (a promote's seal, a point a prune made whole)."""
    return [path for p in pts for v in p.members
            if (path := layout.point_image(unit_id, p.generation, v)).exists()]


def allocated_bytes(path: Path) -> int:
    """Bytes the file holds on disk (0: no file)."""
    return undo_log.allocated(path)


def pin_newer(layout: PoolLayout, idx: Index, generation: int, seconds: float = PIN_NEWER) -> None:
    """Keep the points newer than *generation* at least *seconds* (after a promote to it)."""
    until = time.time() + seconds
    for p in idx.points:
        if p.generation > generation:
            p.pin_until = max(p.pin_until or 0.0, until)
    idx.save(layout)
