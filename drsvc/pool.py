"""The storage pool: a directory of sparse images and durable metadata.

Its paths are built by drsvc.layout.PoolLayout (``pool.layout``), the one
object that joins paths into a pool; the methods below delegate to it.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from . import store
from .errors import CorruptMetadata
from .host import reflink
from .layout import SUBDIRS, PoolLayout
from .logs import logger

log = logger(__name__)


class Pool:
    def __init__(self, root: Path, *, site: str = "local"):
        self.root = Path(root).resolve()
        self.layout = PoolLayout(self.root)
        self.site = site
        self.reflink = False

    @classmethod
    def existing(cls, root: Path) -> Pool:
        """A pool opened by a process that does not own it (the replication receiver):
        its site comes from pool.json, and no reflink probe runs."""
        pool = cls(root, site="")
        for d in SUBDIRS:
            pool.layout.subdir(d).mkdir(parents=True, exist_ok=True)
        pool.site = (store.read_doc(pool.layout.meta) or {}).get("site", "")
        return pool

    def init(self) -> Pool:
        self.root.mkdir(parents=True, exist_ok=True)
        for d in SUBDIRS:
            self.layout.subdir(d).mkdir(exist_ok=True)
        meta = self.layout.meta
        doc = store.read_doc(meta)
        if doc is None:
            store.write_doc(meta, {"site": self.site, "created_at": time.time()})
        self.reflink = reflink.supports_reflink(self.layout.images)
        if not self.reflink:
            log.warning("pool %s is not on a reflink-capable filesystem: snapshots and clones "
                        "fall back to sparse copies and take time proportional to data", self.root)
        return self

    # -- paths: built by the pool's one layout object (drsvc.layout) --------
    def image(self, volume_id: str) -> Path:
        return self.layout.image(volume_id)

    def volume_meta(self, volume_id: str) -> Path:
        return self.layout.volume_meta(volume_id)

    def volume_tombstone(self, volume_id: str) -> Path:
        return self.layout.volume_tombstone(volume_id)

    def snapshot_image(self, snapshot_id: str) -> Path:
        return self.layout.snapshot_image(snapshot_id)

    def snapshot_meta(self, snapshot_id: str) -> Path:
        return self.layout.snapshot_meta(snapshot_id)

    def name_index(self, key: str) -> Path:
        return self.layout.name_index(key)

    def node_state(self, volume_id: str) -> Path:
        return self.layout.node_state(volume_id)

    def group_meta(self, group_id: str) -> Path:
        return self.layout.group_meta(group_id)

    def group_snapshot_meta(self, group_snapshot_id: str) -> Path:
        return self.layout.group_snapshot_meta(group_snapshot_id)

    def staging_image(self, final: Path) -> Path:
        return self.layout.staging_image(final)

    @contextlib.contextmanager
    def lock(self, key: str, *, blocking: bool = False):
        """A per-object lock across threads and processes; busy -> OperationInProgress."""
        with store.file_lock(self.layout.lock(key), blocking=blocking, key=key):
            yield

    @contextlib.contextmanager
    def mount_lock(self, volume_id: str, *, shared: bool = False, wait: float | None = None):
        """Held shared while the volume's staged filesystem is open for a write-back or a
        freeze (a capture, a snapshot), and exclusively by the unmount that ends its
        staging, which so waits for them instead of failing busy; *wait* seconds, then
        OperationInProgress."""
        with store.file_lock(self.layout.mount_lock(volume_id), shared=shared, wait=wait, key=volume_id):
            yield

    def list_docs(self, subdir: str) -> list[dict]:
        docs = []
        for path in sorted(self.layout.subdir(subdir).glob("*.json")):
            try:
                doc = store.read_doc(path)
            except CorruptMetadata as e:
                log.error("%s", e)
                continue
            if doc is not None:
                docs.append(doc)
        return docs

    def list_ids(self, subdir: str) -> list[str]:
        """The ids of the JSON records in *subdir*, sorted, from the directory's names only
        (temp files and tombstones, which start with a dot, are not records)."""
        try:
            names = os.listdir(self.layout.subdir(subdir))
        except FileNotFoundError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and not n.startswith("."))

    def space(self) -> tuple[int, int]:
        """(free, total) bytes of the pool filesystem."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
