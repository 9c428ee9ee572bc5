"""This site's side of a replication relationship, as a durable record (control.json).

Written only by the worker side (drsvc.replication.control.jobs) under the unit's
control lock; read by everything (drsvc.replication.control.read_model).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ... import schedule_changes, store
from ...layout import PoolLayout

DEFAULT_INTERVAL = 300


@dataclass
class Control:
    """This site's side of a replication relationship: settings and sync outcomes."""
    unit_id: str
    kind: str
    members: list
    peer: str
    interval: int = DEFAULT_INTERVAL
    start_time: float | None = None
    bandwidth_limit: int = 0
    enabled_at: float = 0.0
    last_sync_time: float = 0.0          # start of the last successful sync
    last_sync_duration: float = 0.0
    last_sync_bytes: int = 0
    last_error: str = ""
    last_attempt: float = 0.0
    consecutive_failures: int = 0
    syncs_total: int = 0                 # counters: only ever incremented, under the control lock,
    failures_total: int = 0              # in the same atomic write as the outcome they count
    sent_bytes_total: int = 0            # (/metrics reads them: they survive its restarts)
    changed_bytes_total: int = 0         # the data bytes those syncs changed at the peer
    conflict: str = ""                   # split brain or fencing, named for the operator
    last_sync_delay: float = 0.0         # a scheduled sync: its start minus the slot it was due at
    retention: str = ""                  # the unit's recovery point grid (drsvc.io/retention; "": the site's)
    snapshots_shipped: list = field(default_factory=list)   # CSI snapshots the peer holds as points
    verify_interval: int | None = None   # the class's drsvc.io/verifyInterval (None: the verifying site's default)

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> Control:
        return cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})


def control_path(pool: Path, unit_id: str) -> Path:
    return PoolLayout(pool).control_path(unit_id)


def find_control(pool: Path, unit_id: str) -> Control | None:
    doc = store.read_doc(control_path(pool, unit_id))
    return Control.from_doc(doc) if doc else None


def save_control(pool: Path, c: Control) -> None:
    """Write the record, and mark the unit for the scheduler (its interval may be new)."""
    _write(pool, c)
    schedule_changes.mark(pool, c.unit_id)


def _write(pool: Path, c: Control) -> None:
    PoolLayout(pool).ensure_unit_dir(c.unit_id)
    store.write_doc(control_path(pool, c.unit_id), c.to_doc())


def control_lock(pool: Path, unit_id: str):
    layout = PoolLayout(pool)
    layout.ensure_unit_dir(unit_id)
    return store.file_lock(layout.control_lock_path(unit_id))


def update_control(pool: Path, unit_id: str, fn: Callable[[Control], None]) -> Control | None:
    """Read, change and write the record under its lock; None when there is none."""
    with control_lock(pool, unit_id):
        c = find_control(pool, unit_id)
        if c is None:
            return None
        before = (c.interval, c.start_time)
        fn(c)
        # a sync's outcome is written here after every sync: the scheduler hears of it only
        # when what it keys on changed
        (save_control if (c.interval, c.start_time) != before else _write)(pool, c)
        return c


def remove_control(pool: Path, unit_id: str) -> None:
    store.remove(control_path(pool, unit_id))
    schedule_changes.mark(pool, unit_id)


def control_from_origin(st) -> Control | None:
    """A secondary's view of the relationship, from the origin block the primary sends."""
    o = getattr(st, "origin", None) or {}
    if not o.get("site"):
        return None
    return Control(unit_id=st.unit_id, kind=st.kind, members=list(st.members), peer=o["site"],
                   interval=int(o.get("interval") or DEFAULT_INTERVAL), start_time=o.get("start_time"),
                   bandwidth_limit=int(o.get("bandwidth_limit") or 0), enabled_at=time.time(),
                   verify_interval=o.get("verify_interval"))
