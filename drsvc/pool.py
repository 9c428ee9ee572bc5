"""The storage pool: a directory of sparse images and durable metadata.

Layout (all names come from drsvc.ids, never from clients)::

    pool.json                    schema, site, created
    images/<volume_id>.img       volume images (replicas keep the same id)
    volumes/<volume_id>.json     volume metadata
    snapshots/<snapshot_id>.img  snapshot images (reflink copies)
    snapshots/<snapshot_id>.json
    names/<kind>-<sha256>.json   client name -> id index
    group_snapshots/<id>.json    volume group snapshots (members live in snapshots/)
    node/<volume_id>.json        node stage/publish state
    locks/<key>.lock             flock files (per volume, per name)
    replication/                 owned by drsvc.replication
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from . import store
from .errors import CorruptMetadata
from .host import reflink
from .ids import check_id

log = logging.getLogger(__name__)
SUBDIRS = ("images", "volumes", "snapshots", "names", "node", "locks", "replication", "groups",
           "group_snapshots")


class Pool:
    def __init__(self, root: Path, *, site: str = "local"):
        self.root = Path(root).resolve()
        self.site = site
        self.reflink = False

    def init(self) -> Pool:
        self.root.mkdir(parents=True, exist_ok=True)
        for d in SUBDIRS:
            (self.root / d).mkdir(exist_ok=True)
        meta = self.root / "pool.json"
        doc = store.read_doc(meta)
        if doc is None:
            store.write_doc(meta, {"site": self.site, "created_at": time.time()})
        self.reflink = reflink.supports_reflink(self.root / "images")
        if not self.reflink:
            log.warning("pool %s is not on a reflink-capable filesystem: snapshots and clones "
                        "fall back to sparse copies and take time proportional to data", self.root)
        return self

    # -- paths (ids validated before any path is built) --------------------
    def image(self, volume_id: str) -> Path:
        return self.root / "images" / f"{check_id(volume_id)}.img"

    def volume_meta(self, volume_id: str) -> Path:
        return self.root / "volumes" / f"{check_id(volume_id)}.json"

    def snapshot_image(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{check_id(snapshot_id, 'snapshot_id')}.img"

    def snapshot_meta(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{check_id(snapshot_id, 'snapshot_id')}.json"

    def name_index(self, key: str) -> Path:
        return self.root / "names" / f"{key}.json"

    def node_state(self, volume_id: str) -> Path:
        return self.root / "node" / f"{check_id(volume_id)}.json"

    def group_meta(self, group_id: str) -> Path:
        return self.root / "groups" / f"{check_id(group_id, 'volume_group_id')}.json"

    def group_snapshot_meta(self, group_snapshot_id: str) -> Path:
        return self.root / "group_snapshots" / f"{check_id(group_snapshot_id, 'group_snapshot_id')}.json"

    def staging_image(self, final: Path) -> Path:
        """A temp name next to *final*, owned by the operation that creates it."""
        return final.with_name(f".{final.name}.partial")

    @contextlib.contextmanager
    def lock(self, key: str, *, blocking: bool = False):
        """A per-object lock across threads and processes; busy -> OperationInProgress."""
        with store.file_lock(self.root / "locks" / f"{key}.lock", blocking=blocking, key=key):
            yield

    def list_docs(self, subdir: str) -> list[dict]:
        docs = []
        for path in sorted((self.root / subdir).glob("*.json")):
            try:
                doc = store.read_doc(path)
            except CorruptMetadata as e:
                log.error("%s", e)
                continue
            if doc is not None:
                docs.append(doc)
        return docs

    def space(self) -> tuple[int, int]:
        """(free, total) bytes of the pool filesystem."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
