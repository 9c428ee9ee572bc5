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
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import store
from ..config import SiteConfig
from ..dispatch import Dispatcher
from ..errors import (DrsvcError, InvalidInput, InvalidParameter, NotFound, NotPrimary,
                      OperationInProgress, PreconditionFailed, ReplicaIsPrimary,
                      StaleEpoch)
from ..ids import check_id
from ..schedule import assess, parse_interval, parse_start_time
from . import state as unit_state
from .health import final_sync, secondary_health
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
        """Replication exists here: enabled at this site, or a replica received from the peer."""
        return (find_control(self.pool, unit_id) is not None
                or unit_state.find_state(self.pool, unit_id) is not None)

    def _enabled(self, unit: Unit) -> Control | None:
        if not self.is_enabled(unit.unit_id):
            raise PreconditionFailed(f"replication is not enabled for {unit.kind} {unit.unit_id}")
        return find_control(self.pool, unit.unit_id)

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

    # Promote and demote always go through the dispatcher, even when they would be
    # no-ops: the in-flight claim is what turns a concurrent, different operation
    # on the unit into ABORTED. The worker side returns at once when nothing is to do.
    def promote(self, unit: Unit, *, force: bool) -> None:
        self._enabled(unit)
        self._run("promote", unit, force=force)

    def demote(self, unit: Unit, *, force: bool) -> None:
        self._enabled(unit)
        for vid in unit.members:
            node_state = self.site.node.find_state(vid)
            targets = node_state.targets if node_state else {}
            writers = [t for t, o in targets.items() if not o.get("readonly")]
            if writers:
                raise PreconditionFailed(f"volume {vid} is published read-write at {writers[0]}; "
                                         "stop its writers and unpublish it before demoting")
        self._run("demote", unit, force=force)

    def resync(self, unit: Unit, *, force: bool) -> bool:
        self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "secondary":
            raise PreconditionFailed(f"{unit.kind} {unit.unit_id} is not demoted; only a secondary resyncs")
        if not (st.diverged or st.resync_requested):
            return True                       # consistent with the primary's last generation
        if st.resync_requested:
            return False                      # waiting for the primary's compare sync
        return bool(self._run("resync", unit, force=force).get("ready"))

    def info(self, unit: Unit) -> Info:
        self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "primary":
            raise PreconditionFailed(f"{unit.kind} {unit.unit_id} is not primary on site {self.cfg.site}")
        return self.describe(unit.unit_id)

    def describe(self, unit_id: str) -> Info:
        """Status for operators, on either role (the CLI and /metrics use it)."""
        st = unit_state.find_state(self.pool, unit_id)
        c = find_control(self.pool, unit_id) or (self._control_from_origin(st) if st else None)
        if c is None:
            raise NotFound(f"replication is not enabled for {unit_id}")
        role = st.role if st else "primary"
        last = (c.last_sync_time, c.last_sync_duration, c.last_sync_bytes)
        if role == "primary":
            h = assess(now=time.time(), interval=c.interval, enabled_at=c.enabled_at,
                       last_success=c.last_sync_time + c.last_sync_duration if c.last_sync_time else 0,
                       consecutive_failures=c.consecutive_failures, last_error=c.last_error,
                       conflict=c.conflict)
            status, message, lag, missed = h.status, h.message, h.lag_seconds, h.missed_intervals
        else:   # the receiving side reports from its receive records: lag is the data age
            r = secondary_health(st, interval=c.interval)
            status, message, lag, missed = r.status, r.message, r.data_age_seconds, r.silent_intervals
            last = (r.last_received_at, r.last_duration_s, r.last_bytes)
        return Info(role=role, epoch=st.epoch if st else 0, generation=st.generation if st else 0,
                    peer=c.peer, interval=c.interval, last_sync_time=last[0],
                    last_sync_duration=last[1], last_sync_bytes=last[2],
                    status=status, status_message=message, lag_seconds=lag, missed_intervals=missed,
                    consecutive_failures=c.consecutive_failures, failures_total=c.failures_total)

    def units(self) -> list[str]:
        root = PoolLayout(self.pool).replication
        if not root.exists():
            return []
        return sorted({p.parent.name for pat in ("*/control.json", "*/state.json") for p in root.glob(pat)})

    def kind_of(self, unit_id: str) -> tuple[str, list]:
        st = unit_state.find_state(self.pool, unit_id)
        c = find_control(self.pool, unit_id)
        if st is not None:
            return st.kind, list(st.members)
        return (c.kind, list(c.members)) if c else ("volume", [unit_id])

    def clone_replica(self, unit: Unit, prefix: str) -> tuple[int, list]:
        """Consistent read-write clones of the latest replicated generation (for drills).

        The receiver's unit lock keeps deltas out while the reflinks are taken,
        so every member is cloned at the same generation; replication goes on
        afterwards untouched."""
        from ..ids import check_name
        from ..model import MOUNT, Capability, ContentSource
        from .receiver import recover
        check_name(prefix, "name_prefix")
        self._enabled(unit)
        layout = PoolLayout(self.pool)
        with store.file_lock(layout.lock_path(unit.unit_id), blocking=True, key=unit.unit_id):
            recover(layout, unit.unit_id)          # finish a committed delta first
            st = unit_state.get_state(self.pool, unit.unit_id)
            clones = []
            for vid in unit.members:
                src = self.site.volumes.get_volume(vid)
                clones.append(self.site.volumes.create_volume(
                    f"{prefix}-{src.name}"[:128], required_bytes=src.capacity_bytes,
                    capabilities=[Capability(MOUNT, "SINGLE_NODE_WRITER")],
                    source=ContentSource("volume", vid)))
            return st.generation, clones

    def sync_now(self, unit: Unit, *, wait: float | None = None) -> dict:
        self._enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is not None and st.role != "primary":      # refused here: no task is queued
            raise NotPrimary(unit_id=unit.unit_id, role=st.role)
        return self.dispatcher.run("sync", unit.unit_id, {"trigger": "manual"},
                                   wait=self.rpc_wait if wait is None else wait)


    # -- run half (worker) ----------------------------------------------------------------
    def _peer(self, name: str):
        if self._connect is not None:
            return self._connect(name)
        from ..transport.ssh import SshPeer
        p = self.cfg.peer(name)
        return SshPeer(p.host, port=p.port, user=p.user, key_file=p.key, known_hosts=p.known_hosts, name=name)

    def _update_control(self, unit_id: str, fn) -> Control | None:
        layout = PoolLayout(self.pool)
        layout.ensure_unit_dir(unit_id)
        with store.file_lock(layout.unit_dir(unit_id) / ".control.lock"):
            c = find_control(self.pool, unit_id)
            if c is None:
                return None
            fn(c)
            save_control(self.pool, c)
            return c

    def _members(self, c: Control) -> list[str]:
        if c.kind == "group":
            g = self.site.groups.find(c.unit_id)
            return list(g.volume_ids) if g else list(c.members)
        return [c.unit_id]

    def _mountpoints(self, members) -> list[str]:
        return [mp for v in members if (mp := self.site.node.mountpoint(v))]

    def _origin(self, c: Control) -> dict:
        """What the peer must know to take over: sent with every delta."""
        members = self._members(c)
        vols = {}
        for vid in members:
            v = self.site.volumes.find_volume(vid)
            if v is not None:
                vols[vid] = {"name": v.name, "capacity_bytes": v.capacity_bytes, "fs_type": v.fs_type,
                             "parameters": v.parameters, "group_id": v.group_id}
        group = None
        if c.kind == "group" and (g := self.site.groups.find(c.unit_id)) is not None:
            group = {"name": g.name, "parameters": g.parameters, "max_volumes": g.max_volumes}
        return {"site": self.cfg.site, "interval": c.interval, "start_time": c.start_time,
                "bandwidth_limit": c.bandwidth_limit, "kind": c.kind, "volumes": vols, "group": group}

    def _control_from_origin(self, st) -> Control | None:
        o = getattr(st, "origin", None) or {}
        if not o.get("site"):
            return None
        return Control(unit_id=st.unit_id, kind=st.kind, members=list(st.members), peer=o["site"],
                       interval=int(o.get("interval") or DEFAULT_INTERVAL), start_time=o.get("start_time"),
                       bandwidth_limit=int(o.get("bandwidth_limit") or 0), enabled_at=time.time())

    def run_enable(self, unit_id: str, *, kind: str, members: list, peer: str, interval: int,
                   start_time: float | None = None, bandwidth_limit: int = 0) -> dict:
        st = unit_state.find_state(self.pool, unit_id)
        if st is not None and st.role != "primary":
            raise PreconditionFailed(f"{unit_id} is a secondary on site {self.cfg.site}; "
                                     "enable replication where the volume is primary")
        unit_state.ensure_unit(self.pool, unit_id, members, kind=kind, role="primary", peer=peer)
        layout = PoolLayout(self.pool)
        layout.ensure_unit_dir(unit_id)
        with store.file_lock(layout.unit_dir(unit_id) / ".control.lock"):
            c = find_control(self.pool, unit_id) or Control(unit_id=unit_id, kind=kind, members=members,
                                                             peer=peer, enabled_at=time.time())
            c.peer, c.interval, c.start_time, c.bandwidth_limit = peer, interval, start_time, bandwidth_limit
            c.members = members
            save_control(self.pool, c)
        task = self.dispatcher.submit("sync", unit_id, {"trigger": "initial"})
        log.info("replication of %s %s to %s enabled every %ss; initial sync queued (%s)",
                 kind, unit_id, peer, interval, task)
        return {"initial_sync_task": task}

    def run_sync(self, unit_id: str, *, trigger: str = "schedule") -> dict:
        c = find_control(self.pool, unit_id)
        st = unit_state.find_state(self.pool, unit_id)
        if c is None or st is None:
            return {"skipped": "replication is not enabled"}
        if st.role != "primary":
            return {"skipped": f"{st.role} on this site"}
        return self._sync(c, demote=False)

    def _sync(self, c: Control, *, demote: bool) -> dict:
        from .sender import sync_unit
        members = self._members(c)
        t0 = time.time()
        peer = None
        try:
            peer = self._peer(c.peer)
            report = sync_unit(self.pool, c.unit_id, members, peer, mountpoints=self._mountpoints(members),
                               demote=demote, kind=c.kind,
                               bwlimit=c.bandwidth_limit or None, origin=self._origin(c))
        except OperationInProgress:
            raise
        except (ReplicaIsPrimary, StaleEpoch) as e:
            conflict = (f"split brain: peer {c.peer} is primary too and refuses our deltas ({e.message}); "
                        "demote this site and resync it from the peer")
            self._record_failure(c.unit_id, t0, e.message, conflict=conflict)
            raise
        except DrsvcError as e:
            self._record_failure(c.unit_id, t0, e.message)
            raise
        finally:
            if peer is not None:
                peer.close()
        r = report.to_dict()

        def ok(ctl: Control):
            ctl.last_sync_time, ctl.last_sync_duration = r["started_at"], r["duration_s"]
            ctl.last_sync_bytes, ctl.last_attempt = r["bytes_on_wire"], t0
            ctl.consecutive_failures, ctl.last_error, ctl.conflict = 0, "", ""
            ctl.syncs_total += 1
        self._update_control(c.unit_id, ok)
        log.info("synced %s: generation %s -> %s, %d bytes on the wire in %.3fs (%s)", c.unit_id,
                 r["base_generation"], r["target_generation"], r["bytes_on_wire"], r["duration_s"], r["mode"])
        return {k: r[k] for k in ("base_generation", "target_generation", "bytes_on_wire", "bytes_changed",
                                  "duration_s", "mode", "records", "resumed")}

    def _record_failure(self, unit_id: str, t0: float, message: str, *, conflict: str = "") -> None:
        def bad(ctl: Control):
            ctl.last_attempt, ctl.last_error = t0, message
            ctl.consecutive_failures += 1
            ctl.failures_total += 1
            ctl.conflict = conflict
        self._update_control(unit_id, bad)
        log.warning("sync of %s failed: %s", unit_id, message)

    def run_demote(self, unit_id: str, *, force: bool = False) -> dict:
        c = find_control(self.pool, unit_id)
        st = unit_state.get_state(self.pool, unit_id)
        if st.role == "secondary":
            return {"role": "secondary"}
        try:
            out = self._sync(c, demote=True)
            log.info("demoted %s after a final sync to %s", unit_id, c.peer)
            return {"role": "secondary", "final_sync": out}
        except OperationInProgress:
            raise
        except DrsvcError as e:
            # The peer does not hold our latest writes: demote anyway, but remember
            # that this copy diverged so nothing is applied on top of it until a resync.
            unit_state.mark_demoted(self.pool, unit_id)
            unit_state.mark_diverged(self.pool, unit_id, True)
            log.warning("demoted %s without a final sync (%s); it needs a resync", unit_id, e.message)
            return {"role": "secondary", "final_sync": None, "diverged": True}

    def run_promote(self, unit_id: str, *, force: bool = False) -> dict:
        from .takeover import seed_base
        st = unit_state.get_state(self.pool, unit_id)
        if st.role == "primary":
            return {"role": "primary", "epoch": st.epoch}
        if not force:
            if st.peer_demoted_at is None or st.peer_demoted_at != st.generation:
                raise PreconditionFailed(
                    f"the peer has not demoted {unit_id} at this site's generation {st.generation}"
                    + (f" (it demoted at {st.peer_demoted_at})" if st.peer_demoted_at is not None else "")
                    + "; demote it first, or promote with force")
            if st.diverged or st.resync_requested:
                raise PreconditionFailed(f"{unit_id} needs a resync before it can be promoted")
        c = find_control(self.pool, unit_id) or self._control_from_origin(st)
        if c is None:
            raise PreconditionFailed(f"{unit_id} has no record of its peer; cannot become primary")
        # the received images become the acked base, so the next sync ships only changes
        seed_base(self.pool, unit_id)
        final = None if force else final_sync(st)     # planned: the demote's final sync is our last sync
        st = unit_state.promote(self.pool, unit_id)
        with store.file_lock(PoolLayout(self.pool).unit_dir(unit_id) / ".control.lock"):
            c.enabled_at = time.time()
            if final is not None:
                c.last_sync_time, c.last_sync_duration, c.last_sync_bytes = final
                c.enabled_at = final[0]
            c.conflict, c.consecutive_failures = "", 0
            save_control(self.pool, c)
        log.info("promoted %s to primary at epoch %d (%s)", unit_id, st.epoch, "forced" if force else "planned")
        return {"role": "primary", "epoch": st.epoch}

    def run_resync(self, unit_id: str, *, force: bool = False) -> dict:
        st = unit_state.get_state(self.pool, unit_id)
        if st.role != "secondary":
            raise PreconditionFailed(f"{unit_id} is not demoted; only a secondary resyncs")
        if not (st.diverged or st.resync_requested):
            return {"ready": True}
        unit_state.request_resync(self.pool, unit_id)
        return {"ready": False}

    def run_disable(self, unit_id: str) -> dict:
        from .remote import release_peer
        from .sender import release_unit
        c = find_control(self.pool, unit_id)
        st = unit_state.find_state(self.pool, unit_id)
        peer_released = None
        if c is not None and st is not None and st.role == "primary":
            peer = None
            try:
                peer = self._peer(c.peer)
                release_peer(peer, unit_id, delete_image=False)
                peer_released = True
            except DrsvcError as e:
                log.warning("could not release %s at peer %s (%s); its copy stays a secondary "
                            "until released there", unit_id, c.peer, e.message)
                peer_released = False
            finally:
                if peer is not None:
                    peer.close()
        deadline = time.monotonic() + 60
        while True:          # a sync in flight holds the unit: wait for it to end
            try:
                release_unit(self.pool, unit_id)
                break
            except OperationInProgress:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        store.remove(_control_path(self.pool, unit_id))
        return {"peer_released": peer_released}

