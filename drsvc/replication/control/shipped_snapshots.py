"""The CSI snapshots a primary replicates: each becomes a pinned recovery point at the peer.

A volume unit replicates the snapshots of its volume; a group unit replicates the volume
group snapshots taken of exactly its members (a snapshot of one member of a replicated
group is not a point of the group, and is not shipped). The sync that first sees a
snapshot ships its content as a generation of its own, captured from the snapshot's
images rather than the live ones, with the snapshot named in the origin block
(``point``); the live data follows as the next generation. Every origin block lists the
unit's snapshots the origin still holds (``snapshots``): one it no longer lists is deleted
at the peer at the next sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...snapshots import GroupSnapshot


@dataclass(frozen=True)
class Shipment:
    snapshot_id: str              # the snapshot's id (a group snapshot's for a group)
    point: dict                   # the origin block's "point"
    sources: dict                 # volume id -> the snapshot image to capture from
    created_at: float


def candidates(volumes, kind: str, members) -> list[Shipment]:
    """The unit's ready snapshots at this site, oldest first."""
    pool = volumes.pool
    out = []
    if kind == "volume":
        vid = members[0]
        for s in volumes.list_snapshots(source_volume_id=vid).items:
            out.append(Shipment(s.snapshot_id, {
                "kind": "snapshot", "id": s.snapshot_id, "name": s.name, "created_at": s.created_at,
                "members": {vid: {"snapshot_id": s.snapshot_id, "name": s.name}}},
                {vid: pool.snapshot_image(s.snapshot_id)}, s.created_at))
    else:
        for doc in pool.list_docs("group_snapshots"):
            gs = GroupSnapshot.from_doc(doc)
            if gs.state != "ready" or sorted(gs.source_volume_ids) != sorted(members):
                continue
            snaps = {v: volumes.find_snapshot(sid) for v, sid in zip(gs.source_volume_ids, gs.snapshot_ids,
                                                                       strict=True)}
            if any(s is None or s.state != "ready" for s in snaps.values()):
                continue
            out.append(Shipment(gs.group_snapshot_id, {
                "kind": "group-snapshot", "id": gs.group_snapshot_id, "name": gs.name, "created_at": gs.created_at,
                "members": {v: {"snapshot_id": s.snapshot_id, "name": s.name} for v, s in snaps.items()}},
                {v: pool.snapshot_image(s.snapshot_id) for v, s in snaps.items()}, gs.created_at))
    return sorted(out, key=lambda s: (s.created_at, s.snapshot_id))


def pending(cands: list[Shipment], shipped) -> list[Shipment]:
    done = set(shipped)
    return [s for s in cands if s.snapshot_id not in done and all(Path(p).exists() for p in s.sources.values())]
