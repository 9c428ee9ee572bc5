"""Operator health read from durable records (pure functions, plus small file readers).

The receiving side (a secondary) cannot ask the primary how far behind it is,
so it reports from its own *receive records* (``UnitState.received``: one per
committed generation, newest last; docs/design/control.md):

- **data age**: now minus the origin's capture instant of the newest generation held;
- **last received**: commit time, bytes on the wire, begin-to-commit duration;
- **primary silent for N intervals**: whole intervals since the primary was last heard
  from. Past two intervals (plus slack, as for the primary in ``schedule.assess``) the
  unit is DEGRADED.

Also read here, for the status view: the scheduler's next run per unit and the
progress of a running sync (both small files the scheduler and sender keep).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ... import store
from ...layout import PoolLayout

SLACK_S = 5.0
NEXT_RUNS = "scheduler-next.json"     # written by workers/scheduler.py (the leader)


@dataclass(frozen=True)
class ReceiveHealth:
    status: str                 # HEALTHY | DEGRADED
    message: str
    data_age_seconds: float     # now - captured_at of the newest generation held (0 when unknown)
    silent_intervals: int       # whole intervals since the primary was last heard from
    last_received_at: float     # 0.0 when nothing was recorded
    last_duration_s: float
    last_bytes: int
    captured_at: float          # 0.0 when unknown


def last_received(received) -> dict | None:
    return received[-1] if received else None


def assess_secondary(*, now: float, interval: int, generation: int, received, heard_at: float = 0.0,
                     diverged: bool = False, resync_requested: bool = False, peer: str = "",
                     own_capture: float = 0.0) -> ReceiveHealth:
    """Health of a secondary from its receive records.

    heard_at: the last time this copy changed for another reason (it was demoted,
    say), so a freshly demoted site does not report an old silence.
    own_capture: the capture instant of a generation this site made itself (a demoted
    primary's final sync); the data age counts from it while no receive record covers
    the generation held."""
    last = last_received(received or [])
    rx_at = float(last.get("received_at") or 0.0) if last else 0.0
    dur = float(last.get("duration_s") or 0.0) if last else 0.0
    nbytes = int(last.get("bytes") or 0) if last else 0
    cap = float(last.get("captured_at") or 0.0) if last else 0.0
    if own_capture and (last is None or last.get("generation") != generation):
        cap = own_capture
    age = max(0.0, now - cap) if cap else 0.0
    since = max(rx_at, heard_at)
    silence = max(0.0, now - since) if since else 0.0
    silent = int(silence // interval) if interval else 0
    who = f"primary {peer}" if peer else "the primary"
    if diverged:
        return ReceiveHealth("DEGRADED", "demoted with writes the peer does not hold; "
                             "ResyncVolume discards them and follows the primary",
                             age, silent, rx_at, dur, nbytes, cap)
    if resync_requested:
        return ReceiveHealth("DEGRADED", "resync requested; waiting for the primary's next sync",
                             age, silent, rx_at, dur, nbytes, cap)
    if since and silence > 2 * interval + SLACK_S:
        return ReceiveHealth("DEGRADED", f"{who} silent for {silent} intervals ({silence:.0f}s, "
                             f"interval {interval}s); data age {age:.0f}s", age, silent, rx_at, dur, nbytes, cap)
    if not last or (own_capture and cap == own_capture):
        held = f"data age {age:.0f}s (its own, from before its demotion)" if own_capture else \
            "no receive recorded yet"
        return ReceiveHealth("HEALTHY", f"secondary at generation {generation}; {held}",
                             age, silent, rx_at, dur, nbytes, cap)
    return ReceiveHealth("HEALTHY", f"secondary at generation {generation}; data age {age:.0f}s, "
                         f"last received {max(0.0, now - rx_at):.0f}s ago", age, silent, rx_at, dur, nbytes, cap)


def secondary_health(st, *, interval: int, now: float | None = None, last_sync_time: float = 0.0) -> ReceiveHealth:
    """assess_secondary for a UnitState (a missing `received` list reads as empty).

    last_sync_time: this site's own last sync as primary (the control record); at a
    demoted site that is the final sync, whose capture the copy still holds."""
    return assess_secondary(now=time.time() if now is None else now, interval=interval,
                            generation=st.generation, received=getattr(st, "received", None) or [],
                            heard_at=st.updated_at if st.demoted else 0.0, diverged=st.diverged,
                            resync_requested=st.resync_requested,
                            peer=(getattr(st, "origin", None) or {}).get("site") or st.peer or "",
                            own_capture=last_sync_time if st.demoted else 0.0)


def final_sync(st) -> tuple[float, float, int] | None:
    """At a planned promotion: (start, duration, bytes) of the sync that carried the peer's
    demotion, which left both copies equal. The new primary reports it as its last sync, so it
    reads HEALTHY with its lag counted from there, not UNKNOWN until its own first sync."""
    rec = last_received(getattr(st, "received", None) or [])
    if rec is None or st.peer_demoted_at is None or rec.get("generation") != st.generation:
        return None
    end, dur = float(rec["received_at"]), float(rec.get("duration_s") or 0.0)
    return end - dur, dur, int(rec.get("bytes") or 0)


def next_runs_path(pool) -> Path:
    return PoolLayout(pool).root / NEXT_RUNS


def write_next_runs(pool, runs: dict) -> None:
    """The scheduler's next run per unit ({unit_id: epoch s}); ephemeral, so no fsync."""
    store.write_ephemeral_json(next_runs_path(pool), {"written_at": time.time(), "next": runs})


_next_runs_cache: dict[str, tuple[tuple, dict]] = {}


def next_runs(pool) -> dict:
    """The scheduler's published next runs ({unit_id: epoch s}), parsed once per version of
    the file: a listing of every unit reads it once, not once per unit."""
    path = next_runs_path(pool)
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    hit = _next_runs_cache.get(str(path))
    if hit is not None and hit[0] == key:
        return hit[1]
    runs = (store.read_json(path) or {}).get("next") or {}
    _next_runs_cache[str(path)] = (key, runs)
    return runs


def next_sync(pool, unit_id: str, *, interval: float = 0, last_sync: float = 0.0,
              now: float | None = None, runs: dict | None = None) -> float:
    """When the scheduler means to queue this unit's next sync (0.0: not scheduled here).

    The scheduler publishes its next runs when its schedule changes, so a published run may
    have passed; when a sync started at or after it, the run happened, and the next one
    is on the same interval grid (``roll_forward``). *runs*: next_runs(pool), read once by a
    listing of many units."""
    ts = float((next_runs(pool) if runs is None else runs).get(unit_id) or 0.0)
    return roll_forward(ts, interval=interval, last_sync=last_sync, now=time.time() if now is None else now)


def roll_forward(ts: float, *, interval: float, last_sync: float, now: float) -> float:
    """The first run on *ts*'s grid after the last sync, when the run at *ts* has happened
    (a sync started at or after it); else *ts* unchanged (due, or overdue: the scheduler is
    not firing)."""
    if not ts or not interval or ts > now or last_sync < ts - 1.0:
        return ts
    return ts + interval * (int((last_sync - ts) // interval) + 1)
