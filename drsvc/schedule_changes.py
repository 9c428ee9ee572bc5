"""Which units' schedules may have changed since the scheduler last looked, and which
units' next sync the peer asked for now.

One empty file per unit under the pool's ``schedule-changes/``, made by whoever changes
what the scheduler keys on (a unit enabled, disabled, promoted or demoted, its interval
or start time changed), taken away by the scheduler as it re-reads that unit. So a
scheduler's tick reads the units that changed, not every unit of the pool.

A writer changes the unit's records first and marks it after, and the scheduler takes a
mark before it reads the records: a change made while the scheduler reads is marked
again and read on the next tick, never lost.

A secondary that waits on its primary's next sync (a resync that discards divergence,
a repair a verify asked for) asks the primary's receiver for it (the ``soon`` verb),
which marks the unit under ``sync-soon/``. The scheduler that holds the unit's sync
moves it to now, once per mark: one sync, then the unit's ordinary slots again.
"""
from __future__ import annotations

import os

from .layout import PoolLayout, check_id


def mark(pool, unit_id: str) -> None:
    """The unit's schedule may have changed (repeat-safe: one file per unit)."""
    _touch(PoolLayout(pool).schedule_change_path(check_id(unit_id)))


def _touch(path) -> None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    os.close(fd)


def ask_soon(pool, unit_id: str) -> bool:
    """The unit's next sync is wanted now. False when it was asked already and the
    scheduler has not taken the mark yet (repeat-safe: one file per unit)."""
    path = PoolLayout(pool).sync_soon_path(check_id(unit_id))
    if path.exists():
        return False
    _touch(path)
    return True


def take_soon(pool) -> list[str]:
    """The units whose next sync was asked for now, their marks removed."""
    return _take(PoolLayout(pool).sync_soon)


def take(pool) -> list[str]:
    """The marked units, their marks removed (the caller reads their records next)."""
    return _take(PoolLayout(pool).schedule_changes)


def _take(d) -> list[str]:
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            os.unlink(d / name)
        except FileNotFoundError:
            continue
        out.append(name)
    return sorted(out)
