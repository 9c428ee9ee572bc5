"""Volume groups: named sets of volumes that replicate as one (one consistent instant).

A volume belongs to at most one group (LIMIT_VOLUME_TO_ONE_VOLUME_GROUP).
Deleting a group deletes its member volumes, as the CSI-Addons seed says.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from . import store
from .errors import (Conflict, GroupIsReplica, GroupNotFound, InvalidInput, InvalidParameter, PreconditionFailed,
                     ResourceExhausted, VolumeNotFound)
from .ids import check_id, check_map, check_name, name_key, new_id
from .paging import paginate
from .pool import Pool
from .volumes import VolumeService

log = logging.getLogger(__name__)
DEFAULT_MAX_VOLUMES = 32
KNOWN_PARAMETERS = {"maxVolumes"}
# What a VolumeGroupReplicationClass carries (the controller strips replication.storage.openshift.io/*
# and passes the rest to CreateVolumeGroup): accepted, validated by EnableVolumeReplication.
REPLICATION_CLASS_KEYS = {"schedulingInterval", "schedulingStartTime", "bandwidthLimit", "peer"}
CO_PREFIXES = ("csi.storage.k8s.io/", "replication.storage.openshift.io/", "csiaddons.openshift.io/")


@dataclass
class Group:
    group_id: str
    name: str
    parameters: dict = field(default_factory=dict)
    volume_ids: list = field(default_factory=list)
    max_volumes: int = DEFAULT_MAX_VOLUMES
    created_at: float = 0.0
    nodes: list = field(default_factory=list)     # a group spanning storage nodes: every part's node

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> Group:
        return cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})


def _max_volumes(params: dict) -> int:
    raw = params.get("maxVolumes", str(DEFAULT_MAX_VOLUMES))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 1024:
        raise InvalidParameter(key="maxVolumes", reason="must be an integer from 1 to 1024")
    return int(raw)


def _note_ignored(params: dict) -> None:
    """Keys other than ours are the CO's classes' (VolumeGroupClass, VolumeGroupReplicationClass):
    accepted and ignored here, never refused."""
    ignored = sorted(set(params) - KNOWN_PARAMETERS)
    if ignored:
        log.debug("volume group parameters left to replication or ignored: %s", ", ".join(ignored[:16]))


class GroupService:
    def __init__(self, pool: Pool, volumes: VolumeService, *, in_use=None, replicated=None, replica_of=None):
        self.pool = pool
        self.volumes = volumes
        self.in_use = in_use              # volume_id -> reason or ''
        self.replicated = replicated      # unit_id -> bool
        self.replica_of = replica_of      # unit_id -> bool: a secondary here (members follow the peer)

    def find(self, group_id: str) -> Group | None:
        doc = store.read_doc(self.pool.group_meta(group_id))
        return Group.from_doc(doc) if doc else None

    def get(self, group_id: str) -> Group:
        g = self.find(check_id(group_id, "volume_group_id"))
        if g is None:
            raise GroupNotFound(group_id=group_id)
        return g

    def create(self, name: str, parameters: dict | None = None, volume_ids=()) -> Group:
        check_name(name)
        params = dict(check_map(parameters or {}, "parameters"))
        # keys the CO's controllers add (csi-addons, provisioner) are theirs, not ours
        params = {k: v for k, v in params.items() if not k.startswith(CO_PREFIXES)}
        _note_ignored(params)
        limit = _max_volumes(params)
        members = list(dict.fromkeys(check_id(v) for v in volume_ids))
        key = name_key("group", name)
        with self.pool.lock(key):
            idx = store.read_doc(self.pool.name_index(key))
            if idx and (g := self.find(idx["group_id"])) is not None:
                if g.parameters != params:
                    raise Conflict(f"volume group {name!r} exists with different parameters")
                if members and sorted(members) != sorted(g.volume_ids):
                    raise Conflict(f"volume group {name!r} exists with different volumes")
                return g
            if (same := self._group_of_exactly(members)) is not None:
                # the replica of a group at the peer site (or a group made under another name):
                # the VolumeGroupReplicationContent at a failover site names the same volumes
                store.write_doc(self.pool.name_index(key), {"name": name, "group_id": same.group_id})
                return same
            g = Group(group_id=new_id(f"{self.volumes.id_prefix}grp"), name=name, parameters=params, max_volumes=limit,
                      created_at=time.time())
            store.write_doc(self.pool.group_meta(g.group_id), g.to_doc())
            store.write_doc(self.pool.name_index(key), {"name": name, "group_id": g.group_id})
        if members:                              # CreateVolumeGroupRequest.volume_ids (field 4)
            try:
                return self.modify(g.group_id, members)
            except Exception:
                self._forget(g)                  # no half-made group: a retry starts clean
                raise
        return g

    def _group_of_exactly(self, members: list[str]) -> Group | None:
        """The group whose members are exactly *members*, if they all belong to one."""
        if not members:
            return None
        owners = {(v.group_id if (v := self.volumes.find_volume(vid)) else "") for vid in members}
        if len(owners) != 1 or not (owner := owners.pop()):
            return None
        g = self.find(owner)
        return g if g is not None and sorted(g.volume_ids) == sorted(members) else None

    def _forget(self, g: Group) -> None:
        for vid in g.volume_ids:
            self._set_member(vid, "")
        store.remove(self.pool.name_index(name_key("group", g.name)))
        store.remove(self.pool.group_meta(g.group_id))

    def delete(self, group_id: str, delete_volume) -> None:
        """Delete the group and its member volumes (via *delete_volume*)."""
        check_id(group_id, "volume_group_id")
        with self.pool.lock(group_id):
            g = self.find(group_id)
            if g is None:
                return
            if self.replicated and self.replicated(group_id):
                raise PreconditionFailed(f"volume group {group_id} is replicated; disable replication first")
            busy = [f"{v}: {r}" for v in g.volume_ids if self.in_use and (r := self.in_use(v))]
            if busy:
                raise PreconditionFailed(f"volume group {group_id} is in use ({'; '.join(busy)})")
            for vid in list(g.volume_ids):
                self._set_member(vid, "")
                g.volume_ids.remove(vid)
                store.write_doc(self.pool.group_meta(group_id), g.to_doc())
                delete_volume(vid)
            idx_path = self.pool.name_index(name_key("group", g.name))
            idx = store.read_doc(idx_path)
            if idx and idx.get("group_id") == group_id:
                store.remove(idx_path)
            store.remove(self.pool.group_meta(group_id))

    def _set_member(self, volume_id: str, group_id: str) -> None:
        vol = self.volumes.find_volume(volume_id)
        if vol is not None and vol.group_id != group_id:
            vol.group_id = group_id
            store.write_doc(self.pool.volume_meta(volume_id), vol.to_doc())

    def modify(self, group_id: str, volume_ids: list[str], parameters: dict | None = None) -> Group:
        check_id(group_id, "volume_group_id")
        wanted = list(dict.fromkeys(check_id(v) for v in volume_ids))
        params = {k: v for k, v in check_map(parameters or {}, "parameters").items()
                  if not k.startswith(CO_PREFIXES)}
        _note_ignored(params)
        with self.pool.lock(group_id):
            g = self.get(group_id)
            if self.replica_of is not None and self.replica_of(group_id):
                # the csi-addons controller resends the same list on every reconcile: that
                # asks for nothing, so it is answered; only a change is the primary's to make
                if set(wanted) == set(g.volume_ids):
                    return g
                raise GroupIsReplica(group_id=group_id)
            limit = _max_volumes(params) if "maxVolumes" in params else g.max_volumes
            if len(wanted) > limit:
                raise ResourceExhausted(f"volume group {group_id} holds at most {limit} volumes")
            for vid in wanted:
                vol = self.volumes.find_volume(vid)
                if vol is None or vol.state != "ready":
                    raise VolumeNotFound(volume_id=vid)
                if vol.group_id and vol.group_id != group_id:
                    raise InvalidInput(f"volume {vid} already belongs to volume group {vol.group_id}")
                if vid not in g.volume_ids and self.replicated and self.replicated(vid):
                    raise InvalidInput(f"volume {vid} is replicated on its own; disable that first")
            for vid in wanted:
                self._set_member(vid, group_id)
            for vid in [v for v in g.volume_ids if v not in wanted]:
                self._set_member(vid, "")
            g.volume_ids = wanted
            store.write_doc(self.pool.group_meta(group_id), g.to_doc())
            return g

    def join(self, group_id: str, volume_id: str) -> Group:
        """Add one volume (CreateVolume with the volumeGroup parameter)."""
        g = self.get(group_id)
        if volume_id in g.volume_ids:
            return g
        return self.modify(group_id, g.volume_ids + [volume_id])

    def ensure_replica(self, group_id: str, *, name: str, parameters: dict, max_volumes: int,
                       volume_ids: list[str], nodes=()) -> Group:
        """The record of a group replicated from the peer, with the origin's members
        (this node's part of them, when the group spans storage nodes: *nodes*).

        Repeat-safe. A volume the origin no longer lists leaves the group here
        too (its group_id is cleared), so it can be deleted at this site."""
        check_id(group_id, "volume_group_id")
        members = sorted(check_id(v) for v in volume_ids)
        nodes = sorted(nodes)
        with self.pool.lock(group_id, blocking=True):
            g = self.find(group_id)
            if g is not None and g.volume_ids == members and g.nodes == nodes:
                return g
            g = g or Group(group_id=group_id, name=name, parameters=dict(parameters), max_volumes=max_volumes,
                           created_at=time.time())
            for vid in [v for v in g.volume_ids if v not in members]:
                vol = self.volumes.find_volume(vid)
                if vol is not None and vol.group_id == group_id:
                    self._set_member(vid, "")
            g.volume_ids = members
            g.nodes = nodes
            store.write_doc(self.pool.group_meta(group_id), g.to_doc())
            idx = self.pool.name_index(name_key("group", g.name))
            if store.read_doc(idx) is None:
                store.write_doc(idx, {"name": g.name, "group_id": group_id})
            return g

    def ensure_part(self, group_id: str, *, name: str, parameters: dict, volume_ids, nodes) -> Group:
        """This node's part of a group whose members sit on several storage nodes: the
        group's id, name and parameters, this node's members, and every part's node (the
        site controller writes one on each node). Repeat-safe."""
        check_id(group_id, "volume_group_id")
        nodes = sorted({check_id(n, "node") for n in nodes})
        with self.pool.lock(group_id):
            g = self.find(group_id)
            if g is None:
                params = {k: v for k, v in check_map(parameters or {}, "parameters").items()
                          if not k.startswith(CO_PREFIXES)}
                g = Group(group_id=group_id, name=check_name(name), parameters=params,
                          max_volumes=_max_volumes(params), created_at=time.time())
            g.nodes = nodes
            store.write_doc(self.pool.group_meta(group_id), g.to_doc())
            idx = self.pool.name_index(name_key("group", g.name))
            if store.read_doc(idx) is None:
                store.write_doc(idx, {"name": g.name, "group_id": group_id})
        return self.modify(group_id, list(volume_ids))

    def forget_part(self, group_id: str) -> None:
        """Drop this node's part of a spanning group (its members left the group); repeat-safe."""
        with self.pool.lock(check_id(group_id, "volume_group_id")):
            g = self.find(group_id)
            if g is not None:
                self._forget(g)

    def list(self, max_entries: int = 0, token: str = ""):
        groups = sorted((Group.from_doc(d) for d in self.pool.list_docs("groups")),
                        key=lambda g: (g.created_at, g.group_id))
        return paginate(groups, max_entries, token)
