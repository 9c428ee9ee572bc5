"""CSI metadata for replicas: the peer's plugin sees replicated volumes and groups.

The primary sends an *origin* block with each delta (its site, schedule, and
the volumes' names and sizes). The receiver records volume and group
documents under the same IDs, so a CO can re-create the PV at this site.
"""
from __future__ import annotations

import time

from .. import store
from ..errors import ProtocolError
from ..ids import check_id, check_name, name_key
from ..model import Volume
from ..pool import Pool

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
                     "parameters": {str(k)[:128]: str(x)[:128] for k, x in dict(group.get("parameters") or {}).items()}}
        start = raw.get("start_time")
        return {"site": check_id(str(raw["site"]), "site"), "interval": int(raw.get("interval") or 0),
                "start_time": float(start) if start is not None else None,
                "bandwidth_limit": int(raw.get("bandwidth_limit") or 0),
                "kind": "group" if raw.get("kind") == "group" else "volume", "volumes": vols, "group": group}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(reason=f"bad origin block: {e}") from None
    except Exception as e:  # InvalidName and friends from the id checks
        raise ProtocolError(reason=f"bad origin block: {e}") from None


def ensure_replica_metadata(pool_root, unit_id: str, kind: str, origin: dict) -> None:
    pool = Pool(pool_root)
    for d in ("volumes", "names", "groups"):
        (pool.root / d).mkdir(exist_ok=True)
    for vid, v in origin["volumes"].items():
        path = pool.volume_meta(vid)
        doc = store.read_doc(path)
        if doc is None:
            vol = Volume(volume_id=vid, name=v["name"], capacity_bytes=v["capacity_bytes"], fs_type=v["fs_type"],
                         parameters=v["parameters"], group_id=v["group_id"], created_at=time.time(),
                         topology={"topology.drsvc.io/site": pool_root_site(pool)})
            store.write_doc(path, vol.to_doc())
            idx = pool.name_index(name_key("volume", v["name"]))
            if store.read_doc(idx) is None:
                store.write_doc(idx, {"name": v["name"], "volume_id": vid})
        elif doc.get("capacity_bytes", 0) < v["capacity_bytes"]:
            doc["capacity_bytes"] = v["capacity_bytes"]
            store.write_doc(path, doc)
    if kind == "group" and origin.get("group"):
        g = origin["group"]
        path = pool.group_meta(unit_id)
        doc = store.read_doc(path) or {"group_id": unit_id, "name": g["name"], "parameters": g["parameters"],
                                       "max_volumes": g["max_volumes"], "created_at": time.time(), "volume_ids": []}
        members = sorted(origin["volumes"])
        if doc.get("volume_ids") != members:
            doc["volume_ids"] = members
            store.write_doc(path, doc)
            idx = pool.name_index(name_key("group", g["name"]))
            if store.read_doc(idx) is None:
                store.write_doc(idx, {"name": g["name"], "group_id": unit_id})


def pool_root_site(pool: Pool) -> str:
    doc = store.read_doc(pool.root / "pool.json") or {}
    return doc.get("site", "")
