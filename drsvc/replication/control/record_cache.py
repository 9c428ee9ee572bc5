"""A unit's durable records, parsed once per version of each file, for the read model.

A listing of every unit (``drsvc status``, ``/metrics``) would otherwise read and parse
every unit's state.json and control.json on each call, though few of them changed since
the last. Every record is written whole by a rename (``drsvc.store``), so a new version is
a new inode: a file whose (inode, size, mtime, ctime) is the one the cache read is the
same version, and costs one stat. Only what the status reads is kept (of a state, not its
sync reports or sizes, and only its newest receive record; of a points index, its summary),
so the cache stays small per unit.

``reads`` counts the documents parsed: the work a listing did beyond its stats.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

from ... import store
from ...layout import PoolLayout
from ..common.unit_state import UnitState
from ..points import index as points
from ..sender.progress import progress_path
from .relationship import Control
from .verify_record import judge, repair_pending

MISSING = ("missing",)


def signature(path: str):
    """The version of the file at *path*: MISSING when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return MISSING
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class RecordCache:
    """Parsed records by path, each with the signature of the version it was parsed from."""

    def __init__(self, pool):
        self.layout = PoolLayout(pool)
        self._entries: dict[str, tuple] = {}
        self._paths: dict[str, dict] = {}
        self._images: dict[str, str] = {}
        self._lock = threading.Lock()
        self.reads = 0

    def _unit_path(self, unit_id: str, name: str) -> str:
        """The path of the unit's record *name*, built by the layout once per unit."""
        paths = self._paths.get(unit_id)
        if paths is None:
            lay = self.layout
            paths = {"state": str(lay.state_path(unit_id)), "control": str(lay.control_path(unit_id)),
                     "verify": str(lay.verify_path(unit_id)), "points": str(lay.points_index(unit_id)),
                     "progress": str(progress_path(lay.root, unit_id))}
            self._paths[unit_id] = paths
        return paths[name]

    def get(self, path: str, parse: Callable[[str], object]):
        """The record at *path* (None when absent), parsed again only when it changed."""
        sig = signature(path)
        hit = self._entries.get(path)
        if hit is not None and hit[0] == sig:
            return hit[1]
        if sig is MISSING:
            self._entries.pop(path, None)
            return None
        value = parse(path)
        with self._lock:
            self.reads += 1
            self._entries[path] = (sig, value)
        return value

    def version(self, unit_id: str, *names: str) -> tuple:
        """The versions of the unit's records *names* (state, control, verify, points) as last
        read through this cache (no stat: call after reading them), for caches built on it."""
        entries = self._entries
        return tuple((entries.get(self._unit_path(unit_id, n)) or MISSING)[0] for n in names)

    def has_records(self, unit_id: str) -> bool:
        """The unit's directory holds its state.json or its control.json."""
        return os.path.exists(self._unit_path(unit_id, "state")) or os.path.exists(self._unit_path(unit_id, "control"))

    def progress_path(self, unit_id: str) -> str:
        """Where a running sync of the unit writes its progress (``sender.progress``)."""
        return self._unit_path(unit_id, "progress")

    def image_path(self, volume_id: str) -> str:
        """A member's image (the replica's allocation is measured at each listing)."""
        path = self._images.get(volume_id)
        if path is None:
            path = self._images[volume_id] = str(self.layout.image(volume_id))
        return path

    def forget(self, unit_id: str) -> None:
        """Drop what is kept of a unit no longer listed."""
        with self._lock:
            for path in (self._paths.pop(unit_id, None) or {}).values():
                self._entries.pop(path, None)
            self._images.pop(unit_id, None)

    # -- the records the status reads ------------------------------------------------------
    def state(self, unit_id: str) -> UnitState | None:
        return self.get(self._unit_path(unit_id, "state"), _parse_state)

    def control(self, unit_id: str) -> Control | None:
        return self.get(self._unit_path(unit_id, "control"), _parse_control)

    def verify_doc(self, unit_id: str) -> dict:
        return self.get(self._unit_path(unit_id, "verify"), lambda p: store.read_doc(p) or {}) or {}

    def judge_verify(self, st: UnitState) -> dict:
        return judge(self.verify_doc(st.unit_id), generation=st.generation, repair_asked=repair_pending(st))

    def points_summary(self, unit_id: str) -> tuple:
        """(points, their recorded unique bytes, the whole images they hold, the newest point's
        members) of the unit's index, made again when the index or the state changed (a
        promote's seal makes whole images and changes the state, not the index)."""
        sig = signature(self._unit_path(unit_id, "points")), self.version(unit_id, "state")[0]
        hit = self._entries.get(self._unit_path(unit_id, "points"))
        if hit is not None and hit[0] == sig:
            return hit[1]
        idx = points.Index.find(self.layout, unit_id)
        pts = idx.points if idx else []
        value = (len(pts), sum(p.unique_bytes for p in pts), tuple(points.whole_images(self.layout, unit_id, pts)),
                 tuple(pts[-1].members) if pts else ())
        with self._lock:
            self.reads += 1
            self._entries[self._unit_path(unit_id, "points")] = (sig, value)
        return value


def _parse_state(path: str) -> UnitState | None:
    doc = store.read_doc(path)
    if doc is None:
        return None
    st = UnitState.from_doc(doc, path)
    return dataclasses.replace(st, reports=[], sizes={}, received=list(st.received or [])[-1:])


def _parse_control(path: str) -> Control | None:
    doc = store.read_doc(path)
    return Control.from_doc(doc) if doc else None
