"""Volume group snapshots: every member captured at one instant.

A group snapshot is a record (``group_snapshots/<id>.json``) naming ordinary
member snapshots (``snapshots/<id>.{img,json}`` with ``group_snapshot_id``
set), so GetSnapshot, ListSnapshots and CreateVolume from a snapshot treat
members like any other snapshot.

Capture: lock every source volume (sorted, blocking), freeze every mounted
member filesystem, reflink every image, thaw. The freeze window is logged.
Raw block members have no filesystem to freeze: a group of several volumes
with one published read-write in block mode cannot be captured at one
instant, and is refused (FAILED_PRECONDITION, as the spec's table says).

On a multi-node site a group snapshot whose members sit on several nodes is cut
in parts, one per node (:meth:`GroupSnapshotService.create_part`, sent by
drsvc.cluster as node tasks): every node freezes its members, waits at a barrier
until every node is frozen, then clones and thaws. The instant is when the last
node froze; each part records its frozen/cloned/thawed times.

Ordering is intent -> act -> record: the group record and member records are
written as "creating" before any image, so a retry after a crash resumes by
name and the same ids, and delete finds every member to remove.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from . import store
from .errors import (GroupSnapshotExists, GroupSnapshotNotFound, InvalidParameter, MissingField,
                     NotGroupConsistent, SnapshotInGroup, SnapshotListMismatch, SnapshotNotFound,
                     VolumeNotFound)
from .host import freeze, reflink
from .ids import check_id, check_map, check_name, name_key, new_id
from .model import BLOCK, Snapshot
from .pool import Pool
from .volumes import VolumeService

log = logging.getLogger(__name__)
CO_PREFIX = "csi.storage.k8s.io/"


@dataclass
class GroupSnapshot:
    group_snapshot_id: str
    name: str
    source_volume_ids: list = field(default_factory=list)
    snapshot_ids: list = field(default_factory=list)      # same order as source_volume_ids
    parameters: dict = field(default_factory=dict)
    created_at: float = 0.0
    state: str = "creating"                                # creating | ready
    freeze_seconds: float = 0.0
    # a part of a group snapshot cut on several nodes (multi-node site): every node's
    # name, and this part's wall-clock times (the two-phase cut is checked from them)
    nodes: list = field(default_factory=list)
    frozen_at: float = 0.0
    cloned_at: float = 0.0
    thawed_at: float = 0.0

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> GroupSnapshot:
        return cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})


def _check_parameters(parameters: dict | None) -> dict:
    params = dict(check_map(parameters or {}, "parameters"))
    unknown = sorted(k for k in params if not k.startswith(CO_PREFIX))
    if unknown:
        raise InvalidParameter(key=unknown[0], reason="group snapshots take no parameters")
    return {k: v for k, v in params.items() if not k.startswith(CO_PREFIX)}


def find_snapshot_any_state(volumes: VolumeService, snapshot_id: str) -> Snapshot:
    """GetSnapshot: a snapshot still being cut is returned too (ready_to_use false)."""
    snap = volumes.find_snapshot(check_id(snapshot_id, "snapshot_id"))
    if snap is None:
        raise SnapshotNotFound(snapshot_id=snapshot_id)
    return snap


def delete_snapshot(volumes: VolumeService, snapshot_id: str) -> None:
    """DeleteSnapshot: a group member cannot be deleted on its own (spec: INVALID_ARGUMENT)."""
    snap = volumes.find_snapshot(check_id(snapshot_id, "snapshot_id"))
    if snap is not None and snap.group_snapshot_id:
        doc = store.read_doc(volumes.pool.group_snapshot_meta(snap.group_snapshot_id))
        if doc is not None:
            raise SnapshotInGroup(snapshot_id=snapshot_id, group_snapshot_id=snap.group_snapshot_id)
    volumes.delete_snapshot(snapshot_id)


class GroupSnapshotService:
    def __init__(self, pool: Pool, volumes: VolumeService, node):
        self.pool = pool
        self.volumes = volumes
        self.node = node                 # drsvc.node.NodeService: what is mounted/published here

    # -- lookups ---------------------------------------------------------------
    def find(self, group_snapshot_id: str) -> GroupSnapshot | None:
        doc = store.read_doc(self.pool.group_snapshot_meta(group_snapshot_id))
        return GroupSnapshot.from_doc(doc) if doc else None

    def get(self, group_snapshot_id: str, snapshot_ids: list[str] = ()) -> tuple[GroupSnapshot, list[Snapshot]]:
        check_id(group_snapshot_id, "group_snapshot_id")
        gs = self.find(group_snapshot_id)
        if gs is None:
            raise GroupSnapshotNotFound(group_snapshot_id=group_snapshot_id)
        self._check_list(gs, snapshot_ids)
        return gs, self.members(gs)

    def members(self, gs: GroupSnapshot) -> list[Snapshot]:
        snaps = []
        for sid in gs.snapshot_ids:
            snap = self.volumes.find_snapshot(sid)
            if snap is not None:
                snaps.append(snap)
        return snaps

    @staticmethod
    def _check_list(gs: GroupSnapshot, snapshot_ids) -> None:
        """The CO's snapshot_ids, when given, must be exactly the group's members."""
        given = [s for s in snapshot_ids]
        if not given:
            return
        for s in given:
            check_id(s, "snapshot_ids")
        if sorted(set(given)) != sorted(gs.snapshot_ids):
            extra = sorted(set(given) - set(gs.snapshot_ids))
            missing = sorted(set(gs.snapshot_ids) - set(given))
            raise SnapshotListMismatch(group_snapshot_id=gs.group_snapshot_id,
                                       reason=f"not members: {extra}; members not named: {missing}")

    # -- create ----------------------------------------------------------------
    def create(self, name: str, source_volume_ids: list[str], parameters: dict | None = None) -> GroupSnapshot:
        check_name(name)
        if not source_volume_ids:
            raise MissingField(field="source_volume_ids")
        sources = list(dict.fromkeys(check_id(v, "source_volume_ids") for v in source_volume_ids))
        params = _check_parameters(parameters)
        key = name_key("group-snapshot", name)
        with self.pool.lock(key):
            idx = store.read_doc(self.pool.name_index(key))
            if idx and (gs := self.find(idx["group_snapshot_id"])) is not None:
                if sorted(gs.source_volume_ids) != sorted(sources):
                    raise GroupSnapshotExists(name=name, reason="source volumes")
                if gs.parameters != params:
                    raise GroupSnapshotExists(name=name, reason="parameters")
                return gs if gs.state == "ready" else self._capture(gs)
            for vid in sources:
                self.volumes.get_volume(vid)          # NOT_FOUND before anything is written
            self._check_consistent(sources)
            now = time.time()
            prefix = self.volumes.id_prefix
            gs = GroupSnapshot(group_snapshot_id=new_id(f"{prefix}gsnap"), name=name, source_volume_ids=sources,
                               snapshot_ids=[new_id(f"{prefix}snap") for _ in sources], parameters=params,
                               created_at=now)
            store.write_doc(self.pool.group_snapshot_meta(gs.group_snapshot_id), gs.to_doc())
            store.write_doc(self.pool.name_index(key), {"name": name, "group_snapshot_id": gs.group_snapshot_id})
            return self._capture(gs)

    def create_part(self, group_snapshot_id: str, name: str, source_volume_ids: list[str],
                    snapshot_ids: list[str], parameters: dict | None, nodes: list[str], barrier) -> GroupSnapshot:
        """This node's part of a group snapshot cut on several nodes, under the ids the
        site controller chose. *barrier*.wait(timeout) returns once every node's part is
        frozen (raises when one is not in time: the freeze is then let go, nothing kept)."""
        check_id(group_snapshot_id, "group_snapshot_id")
        sources = [check_id(v, "source_volume_ids") for v in source_volume_ids]
        sids = [check_id(v, "snapshot_ids") for v in snapshot_ids]
        params = _check_parameters(parameters)
        with self.pool.lock(group_snapshot_id):
            gs = self.find(group_snapshot_id)
            if gs is not None and gs.state == "ready":
                return gs
            for vid in sources:
                self.volumes.get_volume(vid)
            self._check_consistent(sources)
            gs = gs or GroupSnapshot(group_snapshot_id=group_snapshot_id, name=name, source_volume_ids=sources,
                                     snapshot_ids=sids, parameters=params, created_at=time.time(),
                                     nodes=list(nodes))
            store.write_doc(self.pool.group_snapshot_meta(group_snapshot_id), gs.to_doc())
        try:
            return self._capture(gs, barrier)
        except BaseException:
            self.delete(group_snapshot_id)      # a part not cut at the group's instant is no part
            raise

    def _check_consistent(self, sources: list[str]) -> None:
        if len(sources) < 2:
            return
        for vid in sources:
            st = self.node.find_state(vid)
            if st and st.access_type == BLOCK and any(not t.get("readonly") for t in st.targets.values()):
                raise NotGroupConsistent(reason=f"volume {vid} is published read-write as a raw block device, "
                                                "which has no filesystem to freeze")

    def _capture(self, gs: GroupSnapshot, barrier=None) -> GroupSnapshot:
        pending = []
        for vid, sid in zip(gs.source_volume_ids, gs.snapshot_ids, strict=True):
            snap = self.volumes.find_snapshot(sid)
            if snap is None or snap.state != "ready" or not self.pool.snapshot_image(sid).exists():
                vol = self.volumes.get_volume(vid)
                snap = Snapshot(snapshot_id=sid, name=f"{gs.name}/{vid}", source_volume_id=vid,
                                size_bytes=vol.capacity_bytes, created_at=gs.created_at, state="creating",
                                group_snapshot_id=gs.group_snapshot_id)
                store.write_doc(self.pool.snapshot_meta(sid), snap.to_doc())
                pending.append(snap)
        if pending:
            self._cut(gs, pending, barrier)
        gs.state = "ready"
        store.write_doc(self.pool.group_snapshot_meta(gs.group_snapshot_id), gs.to_doc())
        return gs

    def _cut(self, gs: GroupSnapshot, pending: list[Snapshot], barrier=None) -> None:
        parts = {s.snapshot_id: self.pool.staging_image(self.pool.snapshot_image(s.snapshot_id)) for s in pending}
        for p in parts.values():
            p.unlink(missing_ok=True)
        with contextlib.ExitStack() as stack:
            for vid in sorted({s.source_volume_id for s in pending}):
                stack.enter_context(self.pool.lock(vid, blocking=True))
            self._check_consistent(gs.source_volume_ids)
            images = {s.snapshot_id: self.pool.image(s.source_volume_id) for s in pending}
            for s in pending:
                if not images[s.snapshot_id].exists():
                    raise VolumeNotFound(volume_id=s.source_volume_id)
            mounts = stack.enter_context(self.node.mounts_held([s.source_volume_id for s in pending]))
            t0 = time.monotonic()
            with freeze.frozen(mounts):
                t_frozen = time.monotonic()
                gs.frozen_at = time.time()
                if barrier is not None:
                    barrier.wait()             # every node's members are frozen: the instant
                gs.cloned_at = time.time()
                for s in pending:
                    reflink.clone_file(images[s.snapshot_id], parts[s.snapshot_id])
            window = time.monotonic() - t_frozen
            gs.thawed_at = time.time()
            gs.freeze_seconds = window
            log.info("group snapshot %s (%s): %d member(s) cut at one instant; %d filesystem(s) frozen for "
                     "%.1f ms (freeze took %.1f ms)", gs.group_snapshot_id, gs.name, len(pending), len(mounts),
                     window * 1e3, (t_frozen - t0) * 1e3)
        # durability after the thaw, so the freeze lasts only the clones
        for s in pending:
            final = self.pool.snapshot_image(s.snapshot_id)
            with open(parts[s.snapshot_id], "rb") as f:
                os.fsync(f.fileno())
            os.replace(parts[s.snapshot_id], final)
        store.fsync_dir(self.pool.snapshot_image(pending[0].snapshot_id).parent)
        for s in pending:
            s.state = "ready"
            store.write_doc(self.pool.snapshot_meta(s.snapshot_id), s.to_doc())

    def ensure_replica(self, group_snapshot_id: str, *, name: str, source_volume_ids: list[str],
                       snapshot_ids: list[str], created_at: float) -> GroupSnapshot:
        """A group snapshot taken at the replication peer, here under its ids; its
        members are ensured as snapshots first (VolumeService.ensure_snapshot_replica)."""
        check_id(group_snapshot_id, "group_snapshot_id")
        with self.pool.lock(group_snapshot_id, blocking=True):
            gs = self.find(group_snapshot_id)
            if gs is None or gs.state != "ready":
                gs = GroupSnapshot(group_snapshot_id=group_snapshot_id, name=name,
                                   source_volume_ids=list(source_volume_ids), snapshot_ids=list(snapshot_ids),
                                   created_at=created_at, state="ready")
                store.write_doc(self.pool.group_snapshot_meta(group_snapshot_id), gs.to_doc())
                key = name_key("group-snapshot", name)
                if not store.read_doc(self.pool.name_index(key)):
                    store.write_doc(self.pool.name_index(key), {"name": name, "group_snapshot_id": group_snapshot_id})
            return gs

    # -- delete ----------------------------------------------------------------
    def delete(self, group_snapshot_id: str, snapshot_ids: list[str] = ()) -> None:
        check_id(group_snapshot_id, "group_snapshot_id")
        with self.pool.lock(group_snapshot_id):
            gs = self.find(group_snapshot_id)
            if gs is None:
                return
            self._check_list(gs, snapshot_ids)
            for sid in gs.snapshot_ids:
                self.volumes.delete_snapshot(sid)
            key = name_key("group-snapshot", gs.name)
            idx = store.read_doc(self.pool.name_index(key))
            if idx and idx.get("group_snapshot_id") == group_snapshot_id:
                store.remove(self.pool.name_index(key))
            store.remove(self.pool.group_snapshot_meta(group_snapshot_id))
            log.info("group snapshot %s deleted with %d member(s)", group_snapshot_id, len(gs.snapshot_ids))
