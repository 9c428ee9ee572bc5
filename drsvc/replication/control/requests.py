"""The request side of replication (runs in the plugin).

Each request validates, checks what can be checked from local records, and
hands the operation to a Dispatcher (Celery at the edge), whose in-flight
claim turns a concurrent, different operation on the unit into ABORTED. The
work itself runs in a worker: drsvc.replication.control.jobs.
"""
from __future__ import annotations

from ... import store
from ...config import SiteConfig
from ...dispatch import Dispatcher
from ...errors import (
    DrsvcError,
    InvalidParameter,
    NotPrimary,
    NotSecondary,
    PointNotRestorable,
    RetentionGridInvalid,
    UnitNotFound,
    VolumeInGroup,
    VolumeInUse,
    VolumeIsGroupMember,
)
from ...ids import check_name
from ...layout import PoolLayout
from ...model import MOUNT, Capability, ContentSource
from ...retention import check_grid
from ...schedule import parse_interval, parse_start_time, parse_verify_interval
from ..common import unit_state
from ..points import index
from .enablement import check_group_has_members, replicated_as_secondary, resolve_peer
from .read_model import ReplicationStatus, Unit
from .relationship import DEFAULT_INTERVAL, find_control
from .verify_record import refuse_known_bad

RETENTION = "drsvc.io/retention"
VERIFY_INTERVAL = "drsvc.io/verifyInterval"   # how often the secondary verifies its replica (scrub)
KNOWN_PARAMETERS = {"peer", "schedulingInterval", "schedulingStartTime", "bandwidthLimit", RETENTION, VERIFY_INTERVAL,
                    index.RECOVERY_POINT}    # Promote's, passed to Enable too by the VolumeReplication controller
CO_PREFIXES = ("replication.storage.openshift.io/", "csi.storage.k8s.io/", "csiaddons.openshift.io/")


PROMOTE_ALL_BATCH = "promote-all"   # the in-flight claim of this site's (node's) promote batch
PROMOTE_ALL_WAIT_S = 0.1              # a batch's wait, per unit, past the rpc wait
DEMOTE_ALL_BATCH = "demote-all"     # ... and of its demote batch


class ReplicationRequests:
    def __init__(self, status: ReplicationStatus, cfg: SiteConfig, dispatcher: Dispatcher, *, volumes, node,
                 rpc_wait: float = 20.0):
        self.status = status
        self.cfg = cfg
        self.pool = status.pool
        self.dispatcher = dispatcher
        self.volumes = volumes
        self.node = node
        self.rpc_wait = rpc_wait

    def _run(self, op: str, unit: Unit, **kwargs) -> dict:
        return self.dispatcher.run(op, unit.unit_id, kwargs, wait=self.rpc_wait)

    def enable(self, unit: Unit, params: dict) -> None:
        unknown = sorted(k for k in params if k not in KNOWN_PARAMETERS and not k.startswith(CO_PREFIXES))
        if unknown:
            raise InvalidParameter(key=unknown[0], reason=f"unknown parameter; known: {sorted(KNOWN_PARAMETERS)}")
        peer = resolve_peer(self.cfg, params.get("peer", ""))
        interval = parse_interval(params.get("schedulingInterval", f"{DEFAULT_INTERVAL}s"))
        start = parse_start_time(params.get("schedulingStartTime", ""))
        bw = params.get("bandwidthLimit", "0")
        if not (bw.isascii() and bw.isdigit()):
            raise InvalidParameter(key="bandwidthLimit", reason="bytes per second, a whole number")
        grid = self._retention(params)
        verify = parse_verify_interval(params[VERIFY_INTERVAL]) if params.get(VERIFY_INTERVAL) else None
        if unit.kind == "volume":
            vol = self.volumes.get_volume(unit.unit_id)
            if vol.group_id:
                raise VolumeInGroup(volume_id=unit.unit_id, group_id=vol.group_id)
        check_group_has_members(unit)
        if replicated_as_secondary(self.pool, unit.unit_id):
            return                                   # the replica's site: enabled already
        c = find_control(self.pool, unit.unit_id)
        if c is not None and (c.peer, c.interval, c.retention, c.verify_interval) == (peer, interval, grid, verify):
            return                                   # idempotent: already enabled alike
        self._run("enable", unit, kind=unit.kind, members=list(unit.members), peer=peer,
                  interval=interval, start_time=start, bandwidth_limit=int(bw), retention=grid,
                  **({"verify_interval": verify} if verify is not None else {}))

    @staticmethod
    def _retention(params: dict) -> str:
        """The class's recovery point grid, checked ("": the site's default)."""
        if not params.get(RETENTION):
            return ""
        try:
            return check_grid(params[RETENTION])
        except RetentionGridInvalid as e:
            raise InvalidParameter(key=RETENTION, reason=e.message) from None

    def disable(self, unit: Unit, params: dict) -> None:
        if not self.status.is_enabled(unit.unit_id):
            return
        self._run("disable", unit)

    def refuse_member(self, unit: Unit) -> None:
        """A volume that replicates as a member of its group is not a unit of its own: acting on
        it alone would be a silent no-op (or split the group), so it is refused, naming the group.
        (Disable is not refused here: the VolumeReplication controller finalizes a VR only once
        Disable succeeds, and a member's Enable was refused, so there is nothing to end; the CLI
        refuses `disable --volume <member>` itself.)"""
        if unit.kind != "volume" or self.status.is_enabled(unit.unit_id):
            return
        gid = self.volumes.get_volume(unit.unit_id).group_id
        if gid and self.status.is_enabled(gid):
            raise VolumeIsGroupMember(volume_id=unit.unit_id, group_id=gid)

    # Promote and demote always go through the dispatcher, even when they would be
    # no-ops: the in-flight claim is what turns a concurrent, different operation
    # on the unit into ABORTED. The worker side returns at once when nothing is to do.
    def promote(self, unit: Unit, *, force: bool, params: dict | None = None) -> None:
        """With ``drsvc.io/recoveryPoint`` a secondary takes over at that point: its data
        becomes the volumes'. At a primary the parameter changes nothing, as the
        controllers send the class's parameters with every Promote."""
        self.refuse_member(unit)
        self.status.require_enabled(unit)
        point = self._restore_point(unit, (params or {}).get(index.RECOVERY_POINT, ""))
        self._run("promote", unit, force=force, **({"point": point} if point is not None else {}))

    def _held_as(self, role: str):
        """(unit id, Info, kind, members) of every unit held here as *role*."""
        for unit_id in self.status.units():
            try:
                info, kind, members = self.status.row(unit_id)
            except UnitNotFound:
                continue            # its records are not written yet
            if info.role == role:
                yield unit_id, info, kind, members

    def secondaries(self) -> list[dict]:
        """Every unit held here as secondary, with what a runbook shows of it."""
        return [{"unit_id": u, "kind": kind, "peer": info.peer, "generation": info.generation,
                 "data_age_seconds": info.lag_seconds} for u, info, kind, _members in self._held_as("secondary")]

    def promote_all(self, *, force: bool, units: list | None = None, wait: float = 0.0) -> list[dict]:
        """Promote every unit held here as secondary, or the units of *units* (a caller that
        listed them already: the site controller), in one batch on this site's control worker
        (``jobs.run_promote_all``, where a unit found primary already is answered as it is).
        Returns a row per unit: its listing's (when listed here) with the promote's result.
        *wait* 0: PROMOTE_ALL_WAIT_S a unit past the rpc wait, so a caller hears the batch's
        own answer."""
        rows = self.secondaries() if units is None else [{"unit_id": u} for u in units]
        if not rows:
            return []
        wait = wait or self.rpc_wait + PROMOTE_ALL_WAIT_S * len(rows)
        out = self.dispatcher.run("promote_all", PROMOTE_ALL_BATCH,
                                  {"units": [r["unit_id"] for r in rows], "force": bool(force)}, wait=wait)
        done = {r["unit_id"]: r for r in out["results"]}
        return [{**r, **done.get(r["unit_id"], {"result": "failed", "error": "InternalError",
                                                "message": "the batch did not report it"})} for r in rows]

    def primaries(self) -> list[dict]:
        """Every unit held here as primary, with what a runbook shows of it (and its members)."""
        return [{"unit_id": u, "kind": kind, "peer": info.peer, "generation": info.generation, "members": members}
                for u, info, kind, members in self._held_as("primary")]

    def demote_all(self, *, resync: bool, units: list | None = None, wait: float = 0.0) -> list[dict]:
        """Demote every unit held here as primary, or the units of *units* (listed already by
        the site controller), in one batch on this site's control worker
        (``jobs.run_demote_all``); with *resync*, each is then resynced with force. A unit
        whose volume is attached read-write here is refused, as its own DemoteVolume is.
        Returns a row per unit, as ``promote_all`` does."""
        rows = self.primaries() if units is None else [{"unit_id": u, **self._members_of(u)} for u in units]
        refused, batch = {}, []
        for r in rows:
            try:
                for vid in r.get("members") or ():
                    self.node.ensure_not_attached_read_write(vid)
                batch.append(r["unit_id"])
            except DrsvcError as e:
                refused[r["unit_id"]] = {"result": "failed", "error": type(e).__name__, "message": e.message}
        done = {}
        if batch:
            wait = wait or self.rpc_wait + PROMOTE_ALL_WAIT_S * len(batch) * (2 if resync else 1)
            out = self.dispatcher.run("demote_all", DEMOTE_ALL_BATCH, {"units": batch, "resync": bool(resync)},
                                      wait=wait)
            done = {r["unit_id"]: r for r in out["results"]}
        missing = {"result": "failed", "error": "InternalError", "message": "the batch did not report it"}
        return [{**{k: v for k, v in r.items() if k != "members"},
                 **(refused.get(r["unit_id"]) or done.get(r["unit_id"], missing))} for r in rows]

    def _members_of(self, unit_id: str) -> dict:
        try:
            _info, kind, members = self.status.row(unit_id)
        except UnitNotFound:
            return {}
        return {"kind": kind, "members": members}

    def _restore_point(self, unit: Unit, text: str) -> int | None:
        st = unit_state.find_state(self.pool, unit.unit_id)
        if not text or st is None or st.role == "primary":
            return None
        point = index.find_point(PoolLayout(self.pool), unit.unit_id, text)
        for vid in unit.members:
            if reason := self.node.in_use(vid):
                raise VolumeInUse(volume_id=vid, reason=f"{reason}: a recovery point replaces its data; "
                                                        "unpublish and unstage it first")
        return point.generation

    def demote(self, unit: Unit, *, force: bool) -> None:
        self.refuse_member(unit)
        self.status.require_enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        for vid in unit.members if st is None or st.role == "primary" else ():
            self.node.ensure_not_attached_read_write(vid)   # staged or published: refuse
        self._run("demote", unit, force=force)

    def resync(self, unit: Unit, *, force: bool) -> bool:
        self.refuse_member(unit)
        self.status.require_enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "secondary":
            raise NotSecondary(kind=unit.kind, unit_id=unit.unit_id)
        return bool(self._run("resync", unit, force=force).get("ready"))   # judged by content

    def sync_now(self, unit: Unit, *, wait: float | None = None) -> dict:
        self.refuse_member(unit)
        self.status.require_enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is not None and st.role != "primary":      # refused here: no task is queued
            raise NotPrimary(unit_id=unit.unit_id, role=st.role)
        return self.dispatcher.run("sync", unit.unit_id, {"trigger": "manual"},
                                   wait=self.rpc_wait if wait is None else wait)

    def verify(self, unit: Unit, *, repair: bool = False, wait: float | None = None) -> dict:
        """Verify (scrub) the replica held here (``scrub``); refused at a primary, whose images
        are the live ones (verify the copy at the site that holds it)."""
        self.refuse_member(unit)
        self.status.require_enabled(unit)
        st = unit_state.find_state(self.pool, unit.unit_id)
        if st is None or st.role != "secondary":
            raise NotSecondary(f"{unit.kind} {unit.unit_id} is {st.role if st else 'not held'} on this site: "
                               "a verify reads a replica; run it at the site that holds the copy",
                               kind=unit.kind, unit_id=unit.unit_id)
        return self.dispatcher.run("verify", unit.unit_id, {"repair": bool(repair)},
                                   wait=self.rpc_wait if wait is None else wait)

    def clone_replica(self, unit: Unit, prefix: str, point: str = "", *, force: bool = False) -> tuple[int, list]:
        """Consistent read-write clones of the latest replicated generation, or of a recovery
        point (for drills). What a verify found damaged is cloned only with *force* (to look
        at it): a drill on it would pass or fail for the wrong reason.

        The receiver's unit lock keeps deltas out while the reflinks are taken,
        so every member is cloned at the same generation; replication goes on
        afterwards untouched."""
        from ..receiver.replica import recover
        check_name(prefix, "name_prefix")
        self.refuse_member(unit)
        self.status.require_enabled(unit)
        layout = PoolLayout(self.pool)
        with store.file_lock(layout.lock_path(unit.unit_id), blocking=True, key=unit.unit_id):
            recover(layout, unit.unit_id)          # finish a committed delta first
            st = unit_state.get_state(self.pool, unit.unit_id)
            at = index.find_point(layout, unit.unit_id, point, "recovery_point") if point else None
            if not force:
                refuse_known_bad(self.pool, st, at.generation if at else None, action="clone")
            idx = index.Index.find(layout, unit.unit_id) if at else None
            clones = []
            for vid in unit.members:
                src = self.volumes.get_volume(vid)
                kw = {"source": ContentSource("volume", vid)}
                if at is not None:
                    if vid not in at.members:
                        raise PointNotRestorable(unit_id=unit.unit_id, generation=at.generation,
                                                 reason=f"volume {vid} joined the unit after it")
                    kw = {"source": ContentSource("recovery-point", f"{unit.unit_id}@{at.generation}"),
                          "fill": lambda path, vid=vid: index.build_image(layout, idx, at, vid, path)}
                clones.append(self.volumes.create_volume(
                    f"{prefix}-{src.name}"[:128], required_bytes=src.capacity_bytes,
                    capabilities=[Capability(MOUNT, "SINGLE_NODE_WRITER")], **kw))
            return (at.generation if at else st.generation), clones
