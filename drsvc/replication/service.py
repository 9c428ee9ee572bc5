"""Replication control: enable, disable, promote, demote, resync, sync, info.

Two halves. The *request* half runs in the plugin: it validates, checks what
can be checked from local metadata, and hands the operation to a Dispatcher
(Celery at the edge). The *run_* half runs in a worker: it talks to the peer
over SSH through the engine and records every outcome durably.

Sites share nothing but the SSH link: what one site must know of the other
(demotion, epoch, generation) travels in the replication protocol.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import store
from ..config import SiteConfig
from ..dispatch import Dispatcher
from ..errors import (DrsvcError, GroupNotFound, InvalidInput, InvalidParameter, NotFound,
                      OperationInProgress, PeerUnreachable, PreconditionFailed, ReplicaIsPrimary,
                      StaleEpoch, Unavailable, VolumeNotFound)
from ..ids import check_id
from ..schedule import assess, parse_interval, parse_start_time
from . import state as unit_state
from .layout import PoolLayout

log = logging.getLogger(__name__)
KNOWN_PARAMETERS = {"peer", "schedulingInterval", "schedulingStartTime", "bandwidthLimit"}
CO_PREFIXES = ("replication.storage.openshift.io/", "csi.storage.k8s.io/", "csiaddons.openshift.io/")
DEFAULT_INTERVAL = 300


@dataclass(frozen=True)
class Unit:
    kind: str                  # "volume" | "group"
    unit_id: str
    members: tuple


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
    syncs_total: int = 0
    failures_total: int = 0
    conflict: str = ""                   # split brain or fencing, named for the operator
    diverged: bool = False               # demoted without the peer holding every write
    resync: str = ""                     # "" | "requested" | "done"

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> "Control":
        return cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})


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


@dataclass(frozen=True)
class Schedule:
    unit_id: str
    interval: int
    start_time: float | None


def _control_path(pool: Path, unit_id: str) -> Path:
    return PoolLayout(pool).unit_dir(unit_id) / "control.json"


def find_control(pool: Path, unit_id: str) -> Control | None:
    doc = store.read_doc(_control_path(pool, unit_id))
    return Control.from_doc(doc) if doc else None


def save_control(pool: Path, c: Control) -> None:
    PoolLayout(pool).ensure_unit_dir(c.unit_id)
    store.write_doc(_control_path(pool, c.unit_id), c.to_doc())


def list_schedules(pool: Path) -> list[Schedule]:
    """Units this site must sync on a schedule: enabled and primary here."""
    out = []
    root = PoolLayout(pool).replication
    for path in sorted(root.glob("*/control.json")) if root.exists() else []:
        c = find_control(pool, path.parent.name)
        st = unit_state.find_state(pool, path.parent.name)
        if c is not None and st is not None and st.role == "primary":
            out.append(Schedule(c.unit_id, c.interval, c.start_time))
    return out


class ReplicationService:
    def __init__(self, site, cfg: SiteConfig, dispatcher: Dispatcher, *, rpc_wait: float = 20.0,
                 connect=None):
        self.site = site
        self.cfg = cfg
        self.pool = site.pool.root
        self.dispatcher = dispatcher
        self.rpc_wait = rpc_wait
        self._connect = connect          # peer name -> drsvc.transport.Peer (tests may inject)

    # -- lookups -----------------------------------------------------------------
    def resolve(self, kind: str, ident: str) -> Unit:
        if kind == "group":
            g = self.site.groups.get(check_id(ident, "volume_group_id"))
            return Unit("group", g.group_id, tuple(g.volume_ids))
        vol = self.site.volumes.get_volume(ident)
        return Unit("volume", vol.volume_id, (vol.volume_id,))

    def is_enabled(self, unit_id: str) -> bool:
        return find_control(self.pool, unit_id) is not None

    def _enabled(self, unit: Unit) -> Control:
        c = find_control(self.pool, unit.unit_id)
        if c is None:
            raise PreconditionFailed(f"replication is not enabled for {unit.kind} {unit.unit_id}")
        return c

    def _run(self, op: str, unit: Unit, **kwargs) -> dict:
        return self.dispatcher.run(op, unit.unit_id, kwargs, wait=self.rpc_wait)

    # -- request half (plugin) ------------------------------------------------------
    def enable(self, unit: Unit, params: dict) -> None:
        unknown = sorted(k for k in params if k not in KNOWN_PARAMETERS and not k.startswith(CO_PREFIXES))
        if unknown:
            raise InvalidParameter(key=unknown[0], reason=f"unknown parameter; known: {sorted(KNOWN_PARAMETERS)}")
        peer = self.cfg.peer(params.get("peer", "")).name
        interval = parse_interval(params.get("schedulingInterval", f"{DEFAULT_INTERVAL}s"))
        start = parse_start_time(params.get("schedulingStartTime", ""))
        bw = params.get("bandwidthLimit", "0")
        if not bw.isdigit():
            raise InvalidParameter(key="bandwidthLimit", reason="bytes per second, a whole number")
        if unit.kind == "volume":
            vol = self.site.volumes.get_volume(unit.unit_id)
            if vol.group_id:
                raise InvalidInput(f"volume {unit.unit_id} belongs to volume group {vol.group_id}: "
                                   "replicate the group")
        elif not unit.members:
            raise PreconditionFailed(f"volume group {unit.unit_id} has no volumes")
        c = find_control(self.pool, unit.unit_id)
        if c is not None and (c.peer, c.interval) == (peer, interval):
            return                                   # idempotent: already enabled alike
        self._run("enable", unit, kind=unit.kind, members=list(unit.members), peer=peer,
                  interval=interval, start_time=start, bandwidth_limit=int(bw))

    def disable(self, unit: Unit, params: dict) -> None:
        if not self.is_enabled(unit.unit_id):
            return
        self._run("disable", unit)

    def promote(self, unit: Unit, *, force: bool) -> None:
        self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is not None and st.role == "primary":
            return
        self._run("promote", unit, force=force)

    def demote(self, unit: Unit, *, force: bool) -> None:
        self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is not None and st.role == "secondary":
            return
        for vid in unit.members:
            writers = [t for t, o in ((self.site.node.find_state(vid) or _NoState).targets.items())
                       if not o.get("readonly")]
            if writers:
                raise PreconditionFailed(f"volume {vid} is published read-write at {writers[0]}; "
                                         "stop its writers and unpublish it before demoting")
        self._run("demote", unit, force=force)

    def resync(self, unit: Unit, *, force: bool) -> bool:
        c = self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "secondary":
            raise PreconditionFailed(f"{unit.kind} {unit.unit_id} is not demoted; only a secondary resyncs")
        if c.resync == "done" and not c.diverged:
            return True
        out = self._run("resync", unit, force=force)
        return bool(out.get("ready"))

    def info(self, unit: Unit) -> Info:
        c = self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "primary":
            raise PreconditionFailed(f"{unit.kind} {unit.unit_id} is not primary on site {self.cfg.site}")
        return self.describe(unit.unit_id)

    def describe(self, unit_id: str) -> Info:
        """Status for operators, on either role (the CLI and /metrics use it)."""
        c = find_control(self.pool, unit_id)
        if c is None:
            raise NotFound(f"replication is not enabled for {unit_id}")
        st = unit_state.find_state(self.pool, unit_id)
        role = st.role if st else "primary"
        if role == "primary":
            h = assess(now=time.time(), interval=c.interval, enabled_at=c.enabled_at,
                       last_success=c.last_sync_time + c.last_sync_duration if c.last_sync_time else 0,
                       consecutive_failures=c.consecutive_failures, last_error=c.last_error,
                       conflict=c.conflict)
            status, message, lag, missed = h.status, h.message, h.lag_seconds, h.missed_intervals
        else:
            status, lag, missed = "HEALTHY", 0.0, 0
            message = f"secondary at generation {st.generation if st else 0}"
            if c.diverged:
                status, message = "DEGRADED", ("demoted with writes the peer does not hold; "
                                               "ResyncVolume discards them and follows the primary")
            if c.resync == "requested":
                status, message = "DEGRADED", "resync requested; waiting for the primary's next sync"
        return Info(role=role, epoch=st.epoch if st else 0, generation=st.generation if st else 0,
                    peer=c.peer, interval=c.interval, last_sync_time=c.last_sync_time,
                    last_sync_duration=c.last_sync_duration, last_sync_bytes=c.last_sync_bytes,
                    status=status, status_message=message, lag_seconds=lag, missed_intervals=missed,
                    consecutive_failures=c.consecutive_failures, failures_total=c.failures_total)

    def units(self) -> list[str]:
        root = PoolLayout(self.pool).replication
        return sorted(p.parent.name for p in root.glob("*/control.json")) if root.exists() else []

    def sync_now(self, unit: Unit, *, wait: float | None = None) -> dict:
        self._enabled(unit)
        return self.dispatcher.run("sync", unit.unit_id, {"trigger": "manual"},
                                   wait=self.rpc_wait if wait is None else wait)


class _NoState:
    targets: dict = {}
