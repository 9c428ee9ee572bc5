"""The origin block: what a secondary must know of the primary's unit to take it over.

The primary sends it with each delta (its site, schedule, and the volumes'
names, sizes and group). The receiver validates it (parse_origin) and, at
commit, asks this site's volume and group services for replica records under
the same ids (ensure_replicas), so a CO can re-create the PV at this site. The
engine never writes those records itself.
"""
from __future__ import annotations

from ...errors import ProtocolError
from ...ids import check_id, check_name
from ...pool import Pool
from ...retention import check_grid
from ...schedule import MAX_VERIFY_INTERVAL

MAX_ORIGIN_VOLUMES = 1024


def parse_origin(raw) -> dict | None:
    """Validate an origin block from the wire; None when absent."""
    if raw is None:
        return None
    try:
        vols = {}
        for vid, v in dict(raw.get("volumes") or {}).items():
            vols[check_id(vid)] = {"name": check_name(str(v["name"])), "capacity_bytes": int(v["capacity_bytes"]),
                                   "fs_type": str(v.get("fs_type") or "")[:16],
                                   "parameters": {str(k)[:128]: str(x)[:128] for k, x in
                                                  dict(v.get("parameters") or {}).items()},
                                   "group_id": check_id(v["group_id"], "volume_group_id") if v.get("group_id") else ""}
        if len(vols) > MAX_ORIGIN_VOLUMES:
            raise ValueError("too many volumes")
        group = raw.get("group")
        if group is not None:
            group = {"name": check_name(str(group["name"])), "max_volumes": int(group.get("max_volumes", 32)),
                     "nodes": sorted({check_id(str(n), "node") for n in group.get("nodes") or ()}),
                     "parameters": {str(k)[:128]: str(x)[:128] for k, x in dict(group.get("parameters") or {}).items()}}
        start = raw.get("start_time")
        return {"site": check_id(str(raw["site"]), "site"), "interval": int(raw.get("interval") or 0),
                "start_time": float(start) if start is not None else None,
                "bandwidth_limit": int(raw.get("bandwidth_limit") or 0),
                "verify_interval": _verify_interval(raw.get("verify_interval")),
                "kind": "group" if raw.get("kind") == "group" else "volume", "volumes": vols, "group": group,
                **_points_fields(raw)}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(reason=f"bad origin block: {e}") from None
    except Exception as e:  # InvalidName and friends from the id checks
        raise ProtocolError(reason=f"bad origin block: {e}") from None


def _verify_interval(raw) -> int | None:
    """The class's verify interval (seconds, 0: none; None: the verifying site's default)."""
    if raw is None:
        return None
    secs = int(raw)
    if not 0 <= secs <= MAX_VERIFY_INTERVAL:
        raise ValueError(f"verify_interval {secs}")
    return secs


def _points_fields(raw: dict) -> dict:
    """What recovery points need of the origin: its retention grid, the ids of the
    unit's CSI snapshots it still holds, and, for a generation that ships a CSI snapshot,
    that snapshot (kind snapshot or group-snapshot, its id, name, creation time and, per
    member, the snapshot id and name)."""
    out: dict = {"retention": check_grid(str(raw["retention"])) if raw.get("retention") else None}
    if raw.get("snapshots") is not None:
        out["snapshots"] = sorted({check_id(str(s), "snapshot_id") for s in raw["snapshots"]})
    point = raw.get("point")
    if point is not None:
        if point.get("kind") not in ("snapshot", "group-snapshot"):
            raise ValueError(f"point kind {point.get('kind')!r}")
        out["point"] = {"kind": point["kind"], "id": check_id(str(point["id"]), "snapshot_id"),
                        "name": check_name(str(point["name"])), "created_at": float(point["created_at"]),
                        "members": {check_id(v): {"snapshot_id": check_id(str(m["snapshot_id"]), "snapshot_id"),
                                                  "name": check_name(str(m["name"]))}
                                    for v, m in dict(point["members"]).items()}}
    return out


def ensure_replicas(pool_root, unit_id: str, kind: str, origin: dict) -> None:
    """Ask this site's volume and group services for the records of the replicated unit."""
    from ...groups import GroupService
    from ...volumes import VolumeService
    pool = Pool.existing(pool_root)
    volumes = VolumeService(pool, node_id="")
    for vid, v in origin["volumes"].items():
        volumes.ensure_replica(vid, name=v["name"], capacity_bytes=v["capacity_bytes"], fs_type=v["fs_type"],
                               parameters=v["parameters"], group_id=v["group_id"])
    if kind == "group" and origin.get("group"):
        g = origin["group"]
        GroupService(pool, volumes).ensure_replica(unit_id, name=g["name"], parameters=g["parameters"],
                                                   max_volumes=g["max_volumes"], volume_ids=list(origin["volumes"]),
                                                   nodes=g.get("nodes") or [])


def ensure_snapshot_replica(pool_root, snapshot: dict, created_at: float) -> None:
    """The CSI snapshot a recovery point replicates, at this site under the origin's ids: a
    reflink of each member's replica as just committed (repeat-safe)."""
    from ...snapshots import GroupSnapshotService
    from ...volumes import VolumeService
    pool = Pool.existing(pool_root)
    volumes = VolumeService(pool, node_id="")
    group_id = snapshot["id"] if snapshot["kind"] == "group-snapshot" else ""
    for vid, m in snapshot["members"].items():
        volumes.ensure_snapshot_replica(m["snapshot_id"], name=m["name"], source_volume_id=vid,
                                        created_at=created_at, group_snapshot_id=group_id)
    if group_id:
        GroupSnapshotService(pool, volumes, node=None).ensure_replica(
            group_id, name=snapshot["name"], source_volume_ids=list(snapshot["members"]),
            snapshot_ids=[m["snapshot_id"] for m in snapshot["members"].values()], created_at=created_at)


def drop_snapshot_replica(pool_root, snapshot: dict) -> None:
    """The origin deleted the CSI snapshot: so does this site (repeat-safe)."""
    from ...snapshots import GroupSnapshotService
    from ...volumes import VolumeService
    pool = Pool.existing(pool_root)
    volumes = VolumeService(pool, node_id="")
    if snapshot["kind"] == "group-snapshot":
        GroupSnapshotService(pool, volumes, node=None).delete(snapshot["id"])
    for m in snapshot["members"].values():
        volumes.delete_snapshot(m["snapshot_id"])
