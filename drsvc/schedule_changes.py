"""Which units' schedules may have changed since the scheduler last looked.

One empty file per unit under the pool's ``schedule-changes/``, made by whoever changes
what the scheduler keys on (a unit enabled, disabled, promoted or demoted, its interval
or start time changed), taken away by the scheduler as it re-reads that unit. So a
scheduler's tick reads the units that changed, not every unit of the pool.

A writer changes the unit's records first and marks it after, and the scheduler takes a
mark before it reads the records: a change made while the scheduler reads is marked
again and read on the next tick, never lost.
"""
from __future__ import annotations

import os

from .layout import PoolLayout, check_id


def mark(pool, unit_id: str) -> None:
    """The unit's schedule may have changed (repeat-safe: one file per unit)."""
    path = PoolLayout(pool).schedule_change_path(check_id(unit_id))
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    os.close(fd)


def take(pool) -> list[str]:
    """The marked units, their marks removed (the caller reads their records next)."""
    d = PoolLayout(pool).schedule_changes
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
