"""The replication read model: which units replicate here, their role and health.

Reads the pool's durable records only (control.json and the receiver's
state.json), so the servicers, the CLI's Admin service and /metrics use it
without a dispatcher or a peer.
"""
from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import BadPageToken, DrsvcError, InvalidInput, NoSyncYet, NotEnabled, NotPrimary, UnitNotFound
from ...ids import check_id
from ...layout import PoolLayout
from ...schedule import assess
from ..common import unit_state
from ..points import index as points
from ..receiver.replica import wait_for_apply
from .health import secondary_health
from .record_cache import RecordCache
from .relationship import Control, control_from_origin, find_control


@dataclass(frozen=True)
class Unit:
    kind: str                  # "volume" | "group"
    unit_id: str
    members: tuple


@dataclass(frozen=True)
class Info:
    role: str
    epoch: int
    generation: int
    peer: str
    interval: int
    last_sync_time: float
    last_sync_duration: float
    last_sync_bytes: int
    status: str
    status_message: str
    lag_seconds: float
    missed_intervals: int
    consecutive_failures: int
    failures_total: int
    schedule_delay: float = 0.0        # primary: the last scheduled sync's start minus its slot
    syncs_total: int = 0               # this site's successful syncs as the sender (counter)
    sent_bytes_total: int = 0          # their bytes on the wire (counter)
    changed_bytes_total: int = 0       # the data bytes they changed at the peer (counter)
    verify_interval: int = 0           # secondary: seconds between verifies of the replica (0: none)
    last_verify_time: float = 0.0      # ...end of the last complete verify (never: the first receive)
    verify_failed: bool = False        # ...mismatches found and not repaired
    verify_mismatched_blocks: int = 0  # ...how many blocks differ
    verify_generation: int = 0         # ...the generation they were found at
    verify_message: str = ""
    verify_damaged_points: int = 0     # ...recovery points the last verify found damaged


@dataclass(frozen=True)
class Schedule:
    unit_id: str
    interval: int
    start_time: float | None


def is_enabled(pool: Path, unit_id: str) -> bool:
    """Replication exists here: enabled at this site, or a replica received from the peer."""
    return find_control(pool, unit_id) is not None or unit_state.find_state(pool, unit_id) is not None


def verify_interval_of(c: Control | None, site_default: int) -> int:
    """A replica's verify interval: the class's (drsvc.io/verifyInterval, sent in the origin
    block) or this site's default; 0: not verified on a schedule."""
    v = getattr(c, "verify_interval", None) if c is not None else None
    return int(site_default if v is None else v)


def list_verify_schedules(pool: Path, site_default: int) -> list[Schedule]:
    """Units this site must verify on a schedule: held here as secondary, with an interval."""
    root = PoolLayout(pool).replication
    paths = sorted(root.glob("*/state.json")) if root.exists() else []
    return [s for path in paths if (s := verify_schedule_of(pool, path.parent.name, site_default))]


def verify_schedule_of(pool: Path, unit_id: str, site_default: int) -> Schedule | None:
    """The replica's verify schedule here; None unless it is held here as a secondary with a
    generation and a verify interval."""
    st = unit_state.find_state(pool, unit_id)
    if st is None or st.role != "secondary" or not st.generation:
        return None
    every = verify_interval_of(control_from_origin(st), site_default)
    return Schedule(st.unit_id, every, None) if every else None


def list_schedules(pool: Path) -> list[Schedule]:
    """Units this site must sync on a schedule: enabled and primary here (reads every unit:
    the scheduler does so when it starts to lead, then follows drsvc.schedule_changes)."""
    root = PoolLayout(pool).replication
    found = (schedule_of(pool, path.parent.name) for path in sorted(root.glob("*/control.json"))) \
        if root.exists() else ()
    return [s for s in found if s is not None]


def schedule_of(pool: Path, unit_id: str) -> Schedule | None:
    """The unit's schedule here; None when it is not enabled and primary here."""
    c = find_control(pool, unit_id)
    if c is None:
        return None
    st = unit_state.find_state(pool, unit_id)
    if st is None or st.role != "primary":
        return None
    return Schedule(c.unit_id, c.interval, c.start_time)


class ReplicationStatus:
    """Lookups and status of one site's replication units."""

    def __init__(self, site_id: str, pool: Path, volumes, groups, *, verify_interval: int = 0):
        self.site_id = site_id
        self.verify_interval = verify_interval    # the site's default (SiteConfig.verify_interval)
        self.pool = Path(pool)
        self.volumes = volumes
        self.groups = groups
        self.records = RecordCache(self.pool)     # a listing parses only the records that changed

    def resolve(self, kind: str, ident: str) -> Unit:
        if kind == "group":
            g = self.groups.get(check_id(ident, "volume_group_id"))
            return Unit("group", g.group_id, tuple(g.volume_ids))
        vol = self.volumes.get_volume(ident)
        return Unit("volume", vol.volume_id, (vol.volume_id,))

    def is_enabled(self, unit_id: str) -> bool:
        return is_enabled(self.pool, unit_id)

    def require_enabled(self, unit: Unit) -> Control | None:
        if not self.is_enabled(unit.unit_id):
            raise NotEnabled(kind=unit.kind, unit_id=unit.unit_id)
        return find_control(self.pool, unit.unit_id)

    def info(self, unit: Unit) -> Info:
        """GetVolumeReplicationInfo: answered by the primary only."""
        self.require_enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "primary":
            raise NotPrimary(f"{unit.kind} {unit.unit_id} is not primary on site {self.site_id}",
                             unit_id=unit.unit_id, role=st.role if st else "")
        info = self.describe(unit.unit_id)
        if not info.last_sync_time:
            raise NoSyncYet(unit_id=unit.unit_id)          # the seed's NOT_FOUND, until there is one
        return info

    def describe(self, unit_id: str) -> Info:
        """Status for operators, on either role (the CLI and /metrics use it)."""
        return self.row(unit_id)[0]

    def row(self, unit_id: str) -> tuple[Info, str, list]:
        """describe() and kind_of() from the unit's two records, parsed again only when they
        changed (``record_cache``): a listing's row."""
        st = self.records.state(unit_id)
        own = self.records.control(unit_id)
        info = self._describe(unit_id, st, own or (control_from_origin(st) if st else None))
        if st is not None:
            return info, st.kind, list(st.members)
        return info, own.kind, list(own.members)

    def _describe(self, unit_id: str, st, c) -> Info:
        if c is None:
            raise UnitNotFound(f"replication is not enabled for {unit_id}", unit_id=unit_id)
        role = st.role if st else "primary"
        last = (c.last_sync_time, c.last_sync_duration, c.last_sync_bytes)
        if role == "primary":
            h = assess(now=time.time(), interval=c.interval, enabled_at=c.enabled_at,
                       last_success=c.last_sync_time + c.last_sync_duration if c.last_sync_time else 0,
                       consecutive_failures=c.consecutive_failures, last_error=c.last_error,
                       conflict=c.conflict)
            status, message, lag, missed = h.status, h.message, h.lag_seconds, h.missed_intervals
            verify = {}
        else:   # the receiving side reports from its receive records: lag is the data age
            r = secondary_health(st, interval=c.interval, last_sync_time=c.last_sync_time)
            status, message, lag, missed = r.status, r.message, r.data_age_seconds, r.silent_intervals
            last = (r.last_received_at, r.last_duration_s, r.last_bytes)
            verify = self._verify(st, c)
            if verify["verify_failed"]:
                status, message = "VERIFY_FAILED", f"{verify['verify_message']}; {message}"
        return Info(**verify,role=role, epoch=st.epoch if st else 0, generation=st.generation if st else 0,
                    peer=c.peer, interval=c.interval, last_sync_time=last[0],
                    last_sync_duration=last[1], last_sync_bytes=last[2],
                    status=status, status_message=message, lag_seconds=lag, missed_intervals=missed,
                    consecutive_failures=c.consecutive_failures, failures_total=c.failures_total,
                    schedule_delay=c.last_sync_delay if role == "primary" else 0.0,
                    syncs_total=c.syncs_total, sent_bytes_total=c.sent_bytes_total,
                    changed_bytes_total=c.changed_bytes_total)

    def _verify(self, st, c: Control) -> dict:
        """The replica's verify, as the status reports it (``scrub.VerifyRecord``)."""
        v = self.records.judge_verify(st)
        return {"verify_interval": verify_interval_of(c, self.verify_interval),
                "last_verify_time": v["last_verify_at"] or float(getattr(st, "receiving_since", 0.0) or 0.0),
                "verify_failed": v["failed"], "verify_mismatched_blocks": v["mismatched_blocks"],
                "verify_generation": v["generation"], "verify_message": v["message"],
                "verify_damaged_points": len(v["damaged_points"])}

    def units(self) -> list[str]:
        """Every unit here, in id order: the names of the units' directories, no record read
        (a directory whose records are not written yet is listed: its row is UnitNotFound)."""
        try:
            names = os.listdir(PoolLayout(self.pool).replication)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _is_id(n))

    def units_page(self, max_entries: int = 0, token: str = "") -> tuple[list[str], str]:
        """Unit ids in id order from after *token* (the last id of the previous page), at
        most *max_entries* (0: all), and the next page's token ("" at the end). Only the
        directory's names are listed whole; a page reads its own units' records only."""
        if max_entries < 0:
            raise InvalidInput("max_entries must not be negative")
        if token:
            try:
                check_id(token)
            except DrsvcError:
                raise BadPageToken(token=token[:64]) from None
        layout = PoolLayout(self.pool)
        try:
            names = sorted(os.listdir(layout.replication))
        except FileNotFoundError:
            return [], ""
        out = []
        for name in names[bisect.bisect_right(names, token) if token else 0:]:
            if max_entries and len(out) == max_entries:
                return out, out[-1]
            try:
                if self.records.has_records(name):
                    out.append(name)
            except DrsvcError:          # not a unit's directory
                continue
        return out, ""

    def warm(self) -> int:
        """Read every unit's records into the cache (the first listing after a start would
        otherwise parse them all); returns the units read. Run in a thread of its own."""
        done = 0
        for unit_id in self.units():
            try:
                self.row(unit_id)
                done += 1
            except Exception:  # noqa: BLE001 - a unit half written is read when it is listed
                continue
        return done

    def points(self, unit: Unit):
        """The unit's recovery points at this site, oldest first, and the space they take
        (drsvc.replication.points.listing): one read of the unit's index, once a generation
        acked at its commit marker is applied (its point is made by that apply)."""
        self.require_enabled(unit)
        layout = PoolLayout(self.pool)
        wait_for_apply(layout, unit.unit_id)
        pts, space = points.listing(layout, unit.unit_id, unit.members)
        idx = points.Index.find(layout, unit.unit_id)
        return pts, space, (idx.grid if idx else "")

    def points_summary(self, unit_id: str, members) -> tuple[int, int, int]:
        """(points, their unique bytes, the unit's bytes here: replica + points), from the
        cached summary of its index; the replica's allocation and the points' whole images
        (a promote's seal) are measured on each call, as they change without the index."""
        count, recorded, whole, newest = self.records.points_summary(unit_id)
        kept = recorded + sum(points.unshared_bytes(path) for path in whole)
        replica = sum(points.allocated_bytes(self.records.image_path(v)) for v in (list(members) or newest))
        return count, kept, replica + kept

    def kind_of(self, unit_id: str) -> tuple[str, list]:
        st = unit_state.find_state(self.pool, unit_id)
        c = find_control(self.pool, unit_id)
        if st is not None:
            return st.kind, list(st.members)
        return (c.kind, list(c.members)) if c else ("volume", [unit_id])


def _is_id(name: str) -> bool:
    try:
        check_id(name)
    except DrsvcError:
        return False
    return True
