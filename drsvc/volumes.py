"""Volumes and snapshots in a pool: create, delete, list, expand, snapshot, clone.

Every mutation runs under a per-object lock (a busy lock is ABORTED at the
edge) and is ordered as intent -> act -> record, so a retry after a crash
converges on the same result.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

from . import store
from .errors import (CapacityOutOfRange, CorruptMetadata, DrsvcError, InvalidParameter, MissingField, PoolFull,
                     ResourceExhausted, SnapshotExists, SnapshotNotFound, UnsupportedCapability,
                     VolumeExists, VolumeInUse, VolumeNotFound, InvalidInput)
from .host import filesystems, reflink
from .ids import check_id, check_map, check_name, name_key, new_id
from .model import BLOCK, MOUNT, SINGLE_NODE_MODES, Capability, ContentSource, Snapshot, Volume
from .paging import page_by_id
from .pool import Pool
from .failpoints import failpoint

log = logging.getLogger(__name__)
MiB = 1024 * 1024
DEFAULT_CAPACITY = 1024 * MiB
# StorageClass parameters we understand; the CO's own keys are passed through.
KNOWN_PARAMETERS = {"volumeGroup", "preallocate"}
CO_PREFIX = "csi.storage.k8s.io/"
TOPOLOGY_SITE = "topology.drsvc.io/site"
TOPOLOGY_NODE = "topology.drsvc.io/node"
TOPOLOGY_ZONE = "topology.drsvc.io/zone"


def pair_zone(site: str, peers=(), configured: str = "") -> str:
    """The zone both sites of a pair advertise: the configured one, else the sorted site names."""
    return configured or "-".join(sorted({site, *peers}))


def node_topology(zone: str, pair: str, labels: dict) -> dict:
    """The topology of a storage node of a multi-node site: its zone, its pair's name
    (config.NodeConfig.pair: the same at both nodes of a replication pair, so a PV restored
    at the peer is schedulable on the node that holds its replica), its labels."""
    return {**labels, TOPOLOGY_ZONE: zone, TOPOLOGY_NODE: pair}


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def check_capabilities(caps: list[Capability], *, required: bool = True) -> None:
    if not caps:
        if required:
            raise MissingField(field="volume_capabilities")
        return
    for cap in caps:
        if cap.access_type not in (MOUNT, BLOCK):
            raise UnsupportedCapability(reason="access_type must be mount or block")
        if cap.access_mode == "UNKNOWN":
            raise UnsupportedCapability(reason="access_mode is required")
        if cap.access_mode not in SINGLE_NODE_MODES:
            raise UnsupportedCapability(reason=f"access mode {cap.access_mode} needs more than one node; "
                                               "drsvc volumes are host-local")
        if cap.access_type == MOUNT and cap.fs_type and cap.fs_type not in filesystems.SUPPORTED:
            raise UnsupportedCapability(reason=f"fs_type {cap.fs_type!r} is not one of {filesystems.SUPPORTED}")


class VolumeService:
    def __init__(self, pool: Pool, node_id: str, *, zone: str | None = None, node_labels: dict | None = None,
                 node_pair: str = ""):
        self.pool = pool
        self.node_id = node_id
        self.zone = zone or pool.site
        # a storage node of a multi-node site: its volumes are reachable on it only, so they
        # name it (and its labels); their ids start with its name, so the site's controller
        # routes every later call to it
        self.node_labels = None if node_labels is None else dict(node_labels)
        self.id_prefix = f"{node_id}." if node_labels is not None else ""
        self.node_pair = node_pair or node_id

    # -- topology ------------------------------------------------------------
    # Advertised (NodeGetInfo, every Volume): only the zone, which is the same at both
    # sites of a replication pair, so a PV that Ramen restores at the peer is schedulable
    # there. The site and node keys are still matched in requests (older classes).
    @property
    def topology(self) -> dict:
        if self.node_labels is not None:
            return node_topology(self.zone, self.node_pair, self.node_labels)
        return {TOPOLOGY_ZONE: self.zone}

    def _reachable(self, requisite: list[dict], preferred: list[dict]) -> bool:
        terms = requisite or preferred
        if not terms:
            return True
        mine = {TOPOLOGY_NODE: self.node_id, **self.topology, TOPOLOGY_SITE: self.pool.site}
        return any(all(mine.get(k) == v for k, v in t.items()) for t in terms)

    # -- lookups --------------------------------------------------------------
    def find_volume(self, volume_id: str) -> Volume | None:
        doc = store.read_doc(self.pool.volume_meta(volume_id))
        if not doc:
            return None
        vol = Volume.from_doc(doc)
        vol.topology = self.topology        # host-local here, replica or not: this site's zone
        return vol

    def get_volume(self, volume_id: str) -> Volume:
        vol = self.find_volume(check_id(volume_id))
        if vol is None or vol.state == "creating":
            raise VolumeNotFound(volume_id=volume_id)
        return vol

    def find_snapshot(self, snapshot_id: str) -> Snapshot | None:
        doc = store.read_doc(self.pool.snapshot_meta(snapshot_id))
        return Snapshot.from_doc(doc) if doc else None

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        snap = self.find_snapshot(check_id(snapshot_id, "snapshot_id"))
        if snap is None or snap.state != "ready":
            raise SnapshotNotFound(snapshot_id=snapshot_id)
        return snap

    def _size_for(self, required: int, limit: int, fs_type: str, minimum: int = 0) -> int:
        if required < 0 or limit < 0:
            raise CapacityOutOfRange(reason="must not be negative")
        if limit and required > limit:
            raise CapacityOutOfRange(reason=f"required_bytes {required} exceeds limit_bytes {limit}")
        size = required or (min(DEFAULT_CAPACITY, limit) if limit else DEFAULT_CAPACITY)
        size = max(size, minimum, filesystems.MIN_BYTES.get(fs_type, MiB))
        size = _round_up(size, MiB)
        if limit and size > limit:
            raise CapacityOutOfRange(reason=f"the smallest volume that fits is {size} bytes, "
                                            f"above limit_bytes {limit}")
        _, total = self.pool.space()
        if size > total:
            raise CapacityOutOfRange(reason=f"{size} bytes exceeds the pool's size of {total} bytes")
        return size

    # -- create ---------------------------------------------------------------
    def create_volume(self, name: str, *, required_bytes: int = 0, limit_bytes: int = 0,
                      capabilities: list[Capability] = (), parameters: dict | None = None,
                      source: ContentSource | None = None, requisite: list[dict] = (),
                      preferred: list[dict] = (), fill=None) -> Volume:
        """*fill* (internal: a recovery point's clone, drsvc.replication.control.requests) writes the
        new image at the path it is given, in place of a reflink of *source*."""
        check_name(name)
        check_capabilities(list(capabilities))
        parameters = dict(check_map(parameters or {}, "parameters"))
        unknown = sorted(k for k in parameters if k not in KNOWN_PARAMETERS and not k.startswith(CO_PREFIX))
        if unknown:
            raise InvalidParameter(key=unknown[0], reason=f"unknown parameter; known: {sorted(KNOWN_PARAMETERS)}")
        if parameters.get("preallocate", "false") not in ("true", "false"):
            raise InvalidParameter(key="preallocate", reason="must be 'true' or 'false'")
        fs_types = {c.fs_type for c in capabilities if c.access_type == MOUNT and c.fs_type}
        if len(fs_types) > 1:
            raise UnsupportedCapability(reason=f"conflicting fs_types {sorted(fs_types)}")
        fs_type = fs_types.pop() if fs_types else ""
        if not self._reachable(list(requisite), list(preferred)):
            raise ResourceExhausted(f"volume cannot be placed in the requested topology; this node offers {self.topology}")
        kept = {k: v for k, v in parameters.items() if not k.startswith(CO_PREFIX)}
        src_doc = {"kind": source.kind, "source_id": source.source_id} if source else None

        key = name_key("volume", name)
        index = self.pool.name_index(key)
        with self.pool.lock(key):
            volume_id = self._named(index)
            if volume_id:
                vol = self.find_volume(volume_id)
                if vol is not None:
                    self._check_compatible(vol, required_bytes, limit_bytes, fs_type, kept, src_doc)
                    if vol.state == "ready":
                        # an earlier attempt may have died between its rename and its fsyncs
                        store.fsync_dirs(index.parent, self.pool.image(vol.volume_id).parent,
                                         self.pool.volume_meta(vol.volume_id).parent)
                        return vol
                    # a record that is not ready ('creating', written by older releases before the
                    # image): finish it
                    self.pool.staging_image(self.pool.image(volume_id)).unlink(missing_ok=True)
                    return self._materialise(vol, index, fill=fill)
                # the name's intent is recorded but its volume never was: an attempt died before
                # answering, so nothing was handed out under this id; start it again afresh
                for stale in (self.pool.image(volume_id), self.pool.staging_image(self.pool.image(volume_id))):
                    stale.unlink(missing_ok=True)
                store.remove_temps(self.pool.volume_meta(volume_id))
            source_size = self._source_size(source) if source else 0
            size = self._size_for(required_bytes, limit_bytes, fs_type or filesystems.DEFAULT, source_size)
            vol = Volume(volume_id=volume_id or new_id(f"{self.id_prefix}vol"), name=name, capacity_bytes=size, state="creating",
                         fs_type=fs_type, parameters=kept, source=src_doc, topology=self.topology,
                         created_at=time.time())
            return self._materialise(vol, index, record_name=not volume_id, fill=fill)

    def _check_compatible(self, vol: Volume, required: int, limit: int, fs_type: str,
                          params: dict, src: dict | None) -> None:
        if required and vol.capacity_bytes < required:
            raise VolumeExists(name=vol.name, reason=f"it has {vol.capacity_bytes} bytes, {required} required")
        if limit and vol.capacity_bytes > limit:
            raise VolumeExists(name=vol.name, reason=f"it has {vol.capacity_bytes} bytes, limit is {limit}")
        if fs_type and vol.fs_type and fs_type != vol.fs_type:
            raise VolumeExists(name=vol.name, reason=f"its fs_type is {vol.fs_type}")
        if params != vol.parameters:
            raise VolumeExists(name=vol.name, reason="its parameters differ")
        if src != vol.source:
            raise VolumeExists(name=vol.name, reason="its content source differs")

    def _source_size(self, source: ContentSource) -> int:
        if source.kind == "recovery-point":
            return 0                          # sized by required_bytes (the replica's capacity)
        if source.kind == "snapshot":
            return self.get_snapshot(source.source_id).size_bytes
        if source.kind == "volume":
            return self.get_volume(source.source_id).capacity_bytes
        raise InvalidInput(f"unsupported content source {source.kind!r}")

    def _source_image(self, src: dict):
        if src["kind"] == "snapshot":
            self.get_snapshot(src["source_id"])
            return self.pool.snapshot_image(src["source_id"])
        self.get_volume(src["source_id"])
        return self.pool.image(src["source_id"])

    def _named(self, index) -> str:
        """The volume id the name record at *index* holds ('' when none)."""
        volume_id = store.read_pointer(index, "volume_id")
        return check_id(volume_id) if volume_id else ""

    def _materialise(self, vol: Volume, index, *, record_name: bool = False, fill=None) -> Volume:
        """Record the name (the intent), make the image (act), record the volume ready.

        Ordered so that few journal commits make it all durable. The volume record is
        written under a temp name first. The name record is a pointer (a symlink whose
        target is the volume id: atomic, no data block) renamed in; then the image is
        created (or cloned). The volume record's temp file is fsynced, which on a
        journaling filesystem also commits the name and the image, in that order; the
        image, its directory and the name's directory are then fsynced (nothing left
        to commit for them) and only then is the volume record renamed in and its
        directory fsynced. A durable volume record therefore implies a durable name and
        image; a crash before it leaves at most a name without a volume record, which a
        retry of the same name resumes under the same id (create_volume). Two journal
        commits and one data block for an empty volume, where writing each document in
        turn took eight commits and three data blocks."""
        final = self.pool.image(vol.volume_id)
        vol.state = "ready"
        with contextlib.ExitStack() as stack:
            record = stack.enter_context(store.StagedDoc(self.pool.volume_meta(vol.volume_id), vol.to_doc()))
            if record_name:
                store.write_pointer(index, vol.volume_id, sync_dir=False)
                failpoint("volume.after_name")
            if vol.source:
                self._clone_image(vol, final, fill)
                fd = -1
            else:
                fd = self._empty_image(final, vol.capacity_bytes, vol.parameters.get("preallocate") == "true")
                stack.callback(os.close, fd)
            failpoint("volume.after_image")
            record.sync()
            if fd >= 0:
                os.fsync(fd)
            store.fsync_dirs(final.parent, index.parent)
            failpoint("volume.before_record")
            record.commit()
            failpoint("volume.after_record")
        log.info("volume %s (%s) ready: %d bytes", vol.volume_id, vol.name, vol.capacity_bytes)
        return vol

    def _clone_image(self, vol: Volume, final, fill=None) -> None:
        if final.exists():
            return
        part = self.pool.staging_image(final)
        part.unlink(missing_ok=True)
        if fill is not None:
            fill(part)
        else:
            reflink.clone_file(self._source_image(vol.source), part)
        with open(part, "r+b") as f:
            if os.fstat(f.fileno()).st_size < vol.capacity_bytes:
                f.truncate(vol.capacity_bytes)
            os.fsync(f.fileno())
        os.replace(part, final)

    def _empty_image(self, final, size: int, preallocate: bool) -> int:
        """Open (creating) a sparse or preallocated image of *size* bytes at *final*; the caller
        fsyncs and closes the returned fd.

        One open(O_CREAT) and one ftruncate, no staging name: until the volume record
        names it no one reads it, and a retry finishes (or redoes) it."""
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            if preallocate:
                free, _ = self.pool.space()
                if size > free:
                    final.unlink()
                    raise PoolFull(free=free, needed=size)
                os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- delete ---------------------------------------------------------------
    def delete_volume(self, volume_id: str, *, in_use: callable = None) -> None:
        check_id(volume_id)
        with self.pool.lock(volume_id):
            meta, tombstone = self.pool.volume_meta(volume_id), self.pool.volume_tombstone(volume_id)
            image = self.pool.image(volume_id)
            vol = self.find_volume(volume_id)
            if vol is None:
                doc = store.read_doc(tombstone)         # a delete that died before its answer
                if doc is None:
                    image.unlink(missing_ok=True)
                    return
                vol = Volume.from_doc(doc)
            else:
                if in_use is not None and (reason := in_use(volume_id)):
                    raise VolumeInUse(volume_id=volume_id, reason=reason)
                if vol.group_id:
                    raise VolumeInUse(volume_id=volume_id, reason=f"it is a member of volume group {vol.group_id}")
                # intent: the record is set aside (a rename, no data written): from here on the volume
                # is neither listed nor found, and a retried DeleteVolume finishes from the tombstone
                os.replace(meta, tombstone)
            # act: the image and the name go. The directory fsyncs come together after the unlinks:
            # the first commits the journal (the rename and the unlinks), the others find nothing
            # left to do. Then the record goes (unlink, fsync of its directory).
            for p in (image, self.pool.staging_image(image)):
                p.unlink(missing_ok=True)
            index = self.pool.name_index(name_key("volume", vol.name))
            if self._named(index) == volume_id:
                index.unlink(missing_ok=True)
            store.fsync_dirs(meta.parent, image.parent, index.parent)
            failpoint("volume.before_delete_record")
            store.remove(tombstone)
            log.info("volume %s deleted", volume_id)

    # -- replicas (called by the replication engine at the secondary) ---------
    def ensure_replica(self, volume_id: str, *, name: str, capacity_bytes: int, fs_type: str = "",
                       parameters: dict | None = None, group_id: str = "") -> Volume:
        """The record of a volume replicated from the peer, under the origin's id and name.

        Repeat-safe: creates it once, then follows the origin's size (it only
        grows) and group membership."""
        check_id(volume_id)
        with self.pool.lock(volume_id, blocking=True):
            vol = self.find_volume(volume_id)
            if vol is None:
                vol = Volume(volume_id=volume_id, name=name, capacity_bytes=capacity_bytes, fs_type=fs_type,
                             parameters=dict(parameters or {}), group_id=group_id, created_at=time.time(),
                             topology={TOPOLOGY_SITE: self.pool.site})
                store.write_doc(self.pool.volume_meta(volume_id), vol.to_doc())
                idx = self.pool.name_index(name_key("volume", name))
                if not self._named(idx):
                    store.write_pointer(idx, volume_id)
                return vol
            if vol.capacity_bytes < capacity_bytes or vol.group_id != group_id:
                vol.capacity_bytes = max(vol.capacity_bytes, capacity_bytes)
                vol.group_id = group_id
                store.write_doc(self.pool.volume_meta(volume_id), vol.to_doc())
            return vol

    # -- list / capacity / expand ---------------------------------------------
    def list_volumes(self, max_entries: int = 0, token: str = ""):
        """Ready volumes in id order (page_by_id), a page reading its own volumes' records only."""
        return page_by_id(self.pool.list_ids("volumes"), max_entries, token, self._listed_volume, marker="vol-")

    def _listed_volume(self, volume_id: str) -> Volume | None:
        try:
            vol = self.find_volume(volume_id)
        except CorruptMetadata as e:
            log.error("%s", e)
            return None
        except DrsvcError:              # a name that is no volume id
            return None
        return vol if vol is not None and vol.state == "ready" else None

    def capacity(self, topology: dict | None = None, capabilities: list[Capability] = (),
                 parameters: dict | None = None) -> tuple[int, int, int]:
        """(available, maximum_volume_size, minimum_volume_size) for this pool."""
        if topology and not self._reachable([topology], []):
            return 0, 0, 0
        try:
            check_capabilities(list(capabilities), required=False)
        except UnsupportedCapability:
            return 0, 0, 0
        free, total = self.pool.space()
        return free, total, MiB

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int) -> int:
        check_id(volume_id)
        with self.pool.lock(volume_id):
            vol = self.get_volume(volume_id)
            if required_bytes <= 0 and limit_bytes <= 0:
                raise MissingField(field="capacity_range")
            if limit_bytes and vol.capacity_bytes > limit_bytes:
                raise CapacityOutOfRange(reason=f"volume has {vol.capacity_bytes} bytes; shrinking to "
                                                f"limit_bytes {limit_bytes} is not supported")
            target = self._size_for(required_bytes, limit_bytes, "")
            if target <= vol.capacity_bytes:
                return vol.capacity_bytes
            with open(self.pool.image(volume_id), "r+b") as f:
                if os.fstat(f.fileno()).st_size < target:
                    f.truncate(target)
                os.fsync(f.fileno())
            vol.capacity_bytes = target
            store.write_doc(self.pool.volume_meta(volume_id), vol.to_doc())
            return target

    def unsupported_reason(self, vol: Volume, capabilities: list[Capability], parameters: dict) -> str:
        """Why *capabilities* cannot be honoured for *vol*, or '' when they can."""
        check_capabilities(capabilities)
        try:
            check_map(parameters, "parameters")
        except InvalidParameter as e:
            return e.message
        for cap in capabilities:
            if cap.access_type == MOUNT and cap.fs_type and vol.fs_type and cap.fs_type != vol.fs_type:
                return f"volume was created for {vol.fs_type}, not {cap.fs_type}"
        return ""

    def condition(self, volume_id: str) -> str:
        """A problem with the volume's backing storage, or '' when healthy."""
        if not self.pool.image(volume_id).exists():
            return "backing image is missing"
        return ""

    # -- snapshots -------------------------------------------------------------
    def create_snapshot(self, name: str, source_volume_id: str, *, parameters: dict | None = None,
                        freeze=None) -> Snapshot:
        """Snapshot a volume. *freeze* is a context-manager factory that makes
        the copy crash-consistent (the node freezes a mounted filesystem)."""
        check_name(name)
        check_id(source_volume_id, "source_volume_id")
        params = check_map(parameters or {}, "parameters")
        unknown = sorted(k for k in params if not k.startswith("csi.storage.k8s.io/"))
        if unknown:
            raise InvalidParameter(key=unknown[0], reason="snapshots take no parameters")
        key = name_key("snapshot", name)
        with self.pool.lock(key):
            idx = store.read_doc(self.pool.name_index(key))
            if idx:
                snap = self.find_snapshot(idx["snapshot_id"])
                if snap is not None:
                    if snap.source_volume_id != source_volume_id:
                        raise SnapshotExists(name=name)
                    if snap.state == "ready":
                        return snap
                    return self._capture(snap, freeze)
            vol = self.get_volume(source_volume_id)
            snap = Snapshot(snapshot_id=new_id(f"{self.id_prefix}snap"), name=name, source_volume_id=source_volume_id,
                            size_bytes=vol.capacity_bytes, created_at=time.time(), state="creating")
            store.write_doc(self.pool.snapshot_meta(snap.snapshot_id), snap.to_doc())
            store.write_doc(self.pool.name_index(key), {"name": name, "snapshot_id": snap.snapshot_id})
            return self._capture(snap, freeze)

    def _capture(self, snap: Snapshot, freeze) -> Snapshot:
        final = self.pool.snapshot_image(snap.snapshot_id)
        if not final.exists():
            part = self.pool.staging_image(final)
            part.unlink(missing_ok=True)
            with self.pool.lock(snap.source_volume_id, blocking=True):
                src = self.pool.image(snap.source_volume_id)
                if not src.exists():
                    raise VolumeNotFound(volume_id=snap.source_volume_id)
                if freeze is not None:
                    with freeze(snap.source_volume_id):
                        reflink.clone_file(src, part)
                else:
                    reflink.clone_file(src, part)
            os.replace(part, final)
            store.fsync_dir(final.parent)
        snap.state = "ready"
        store.write_doc(self.pool.snapshot_meta(snap.snapshot_id), snap.to_doc())
        return snap

    def ensure_snapshot_replica(self, snapshot_id: str, *, name: str, source_volume_id: str, created_at: float,
                                group_snapshot_id: str = "") -> Snapshot:
        """A snapshot taken at the replication peer, here under its id and name: a
        reflink of the replica as the generation that carried it was committed. Repeat-safe."""
        check_id(snapshot_id, "snapshot_id")
        with self.pool.lock(snapshot_id, blocking=True):
            snap = self.find_snapshot(snapshot_id)
            if snap is not None and snap.state == "ready" and self.pool.snapshot_image(snapshot_id).exists():
                return snap
            snap = Snapshot(snapshot_id=snapshot_id, name=name, source_volume_id=source_volume_id,
                            size_bytes=os.path.getsize(self.pool.image(source_volume_id)), created_at=created_at,
                            state="creating", group_snapshot_id=group_snapshot_id)
            store.write_doc(self.pool.snapshot_meta(snapshot_id), snap.to_doc())
            key = name_key("snapshot", name)
            if not store.read_doc(self.pool.name_index(key)):
                store.write_doc(self.pool.name_index(key), {"name": name, "snapshot_id": snapshot_id})
            return self._capture(snap, None)

    def delete_snapshot(self, snapshot_id: str) -> None:
        check_id(snapshot_id, "snapshot_id")
        with self.pool.lock(snapshot_id):
            snap = self.find_snapshot(snapshot_id)
            store.remove(self.pool.snapshot_image(snapshot_id))
            if snap is None:
                return
            key = name_key("snapshot", snap.name)
            idx = store.read_doc(self.pool.name_index(key))
            if idx and idx.get("snapshot_id") == snapshot_id:
                store.remove(self.pool.name_index(key))
            store.remove(self.pool.snapshot_meta(snapshot_id))

    def list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                       source_volume_id: str = ""):
        """Ready snapshots in id order, as list_volumes. With *snapshot_id*, that one record is
        read; with *source_volume_id* alone, every record after the token is read until the
        page is full (no index by source)."""
        ids = [snapshot_id] if snapshot_id else self.pool.list_ids("snapshots")

        def load(sid: str) -> Snapshot | None:
            try:
                snap = self.find_snapshot(sid)
            except CorruptMetadata as e:
                log.error("%s", e)
                return None
            except DrsvcError:          # a name (or a requested id) that is no snapshot id
                return None
            if snap is None or snap.state != "ready":
                return None
            return snap if not source_volume_id or snap.source_volume_id == source_volume_id else None
        return page_by_id(ids, max_entries, token, load, marker="snap-")
