"""The worker side of replication: the bodies of the drsvc.<op> tasks.

Each job takes a unit id, reloads its records, talks to the peer through the
engine, and records every outcome durably (control.json, state.json). Jobs
are safe to repeat: a task redelivered after a worker died converges.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ... import store
from ...config import SiteConfig
from ...dispatch import Dispatcher
from ...errors import (
    BrokerUnreachable,
    DrsvcError,
    NeedsResync,
    NotGroupConsistent,
    NotSecondary,
    OperationInProgress,
    PeerNotDemoted,
    PeerNotRecorded,
    SplitBrain,
)
from ...layout import PoolLayout
from ...retention import DEFAULT_GRID
from ...transport import Peer
from ...transport.bandwidth import LocalBandwidth, SiteBandwidth, TokenBucket, combine
from ..common import unit_state
from ..common.replica_maps import ReplicaMaps
from . import shipped_snapshots
from .health import final_sync
from .verify_record import VerifyRecord, refuse_known_bad
from .relationship import (
    Control,
    control_from_origin,
    control_lock,
    find_control,
    remove_control,
    save_control,
    update_control,
)

log = logging.getLogger(__name__)


# The engine modules the jobs import inside their functions: a plugin that builds the jobs
# never loads them, and a worker imports them before its pool forks (``workers.main``).
JOB_MODULES = ("drsvc.replication.sender.sync", "drsvc.replication.control.takeover",
               "drsvc.replication.points.restore", "drsvc.replication.receiver.replica",
               "drsvc.replication.control.consistency", "drsvc.replication.sender.base_store",
               "drsvc.replication.control.scrub")

# promotes one batch runs at once: a promote is mostly fsyncs (its state, control record and
# base), which overlap across threads where one after another they add up
PROMOTE_THREADS = 8


def batch_row(action: str, batch: str, unit_id: str, run: Callable[[], dict]) -> dict:
    """One unit's row of a batch: what *run* returns, or its failure by its error's name (an
    error drsvc does not name: InternalError, its traceback in the log)."""
    try:
        return run()
    except DrsvcError as e:
        return {"result": "failed", "error": type(e).__name__, "message": e.message}
    except Exception as e:  # noqa: BLE001 - one unit's failure is its row, not the batch's
        log.exception("%s of %s in batch %s failed", action, unit_id, batch)
        return {"result": "failed", "error": "InternalError",
                "message": f"the {action} failed unexpectedly ({type(e).__name__}); the control worker's log "
                           "has its traceback"}


class ReplicationJobs:
    def __init__(self, cfg: SiteConfig, pool: Path, *, volumes, groups, node,
                 peers: Callable[[str], Peer], dispatcher: Dispatcher | None):
        self.cfg = cfg
        self.pool = Path(pool)
        self.volumes = volumes
        self.groups = groups
        self.node = node
        self.peers = peers
        self.dispatcher = dispatcher
        self._bandwidth: SiteBandwidth | None = None

    # -- what a sync needs to know of this site ----------------------------------------
    def _members(self, c: Control) -> list[str]:
        if c.kind == "group":
            g = self.groups.find(c.unit_id)
            return list(g.volume_ids) if g else list(c.members)
        return [c.unit_id]

    def _mounts(self, members):
        """The capture's hold on the members' staged filesystems (``NodeService.mounts_held``)."""
        return lambda: self.node.mounts_held(members)

    def _origin(self, c: Control, ships=(), point: dict | None = None) -> dict:
        """What the peer must know to take over: sent with every delta. With recovery points:
        the grid the peer keeps them by, the unit's CSI snapshots this site still holds, and
        for a generation that ships one of them, that snapshot."""
        members = self._members(c)
        vols = {}
        for vid in members:
            v = self.volumes.find_volume(vid)
            if v is not None:
                vols[vid] = {"name": v.name, "capacity_bytes": v.capacity_bytes, "fs_type": v.fs_type,
                             "parameters": v.parameters, "group_id": v.group_id}
        group = None
        if c.kind == "group" and (g := self.groups.find(c.unit_id)) is not None:
            group = {"name": g.name, "parameters": g.parameters, "max_volumes": g.max_volumes,
                     "nodes": [self._replica_node(n) for n in g.nodes]}
        return {"site": self.cfg.site, "interval": c.interval, "start_time": c.start_time,
                "bandwidth_limit": c.bandwidth_limit, "kind": c.kind, "volumes": vols, "group": group,
                "retention": c.retention or self.cfg.retention or DEFAULT_GRID,
                "snapshots": [s.snapshot_id for s in ships], "point": point, "verify_interval": c.verify_interval}

    def _replica_node(self, node: str) -> str:
        """The peer site's node that holds *node*'s replicas (node pairs, ``peer_node``)."""
        nc = self.cfg.nodes.get(node)
        return nc.replica_node if nc is not None else node

    def _cut(self, c: Control, *, demote: bool = False):
        """How this node's part of a group spanning storage nodes meets the others, or None;
        demote: a Demote's final round, which meets only the others' final rounds."""
        if c.kind != "group" or (g := self.groups.find(c.unit_id)) is None or len(g.nodes) < 2:
            return None
        make = getattr(self.dispatcher, "cut", None)
        if make is None:
            raise BrokerUnreachable(reason=f"group {c.unit_id} spans nodes {g.nodes}: its syncs need the "
                                           "site's Redis to meet")
        return make(c.unit_id, g.nodes, demote=demote)

    def _site_bandwidth(self) -> SiteBandwidth:
        """The site's caps (``bwlimit``): in the site's Redis when the dispatcher has one
        (``workers.bandwidth``), else buckets of this process alone."""
        if self._bandwidth is None:
            make = getattr(self.dispatcher, "bandwidth", None)
            self._bandwidth = make() if make is not None else LocalBandwidth(self.cfg.cap_schedules)
        return self._bandwidth

    def _limiter(self, c: Control):
        """Everything a sync of *c* sends goes through: the unit's bandwidthLimit (its own),
        then the site's shared caps; None when neither is set."""
        return combine(TokenBucket(c.bandwidth_limit) if c.bandwidth_limit else None,
                       self._site_bandwidth().limiter(c.unit_id, c.peer))

    def peer_of(self, unit_id: str) -> str:
        """The peer this site replicates *unit_id* to ("" when not enabled here)."""
        c = find_control(self.pool, unit_id)
        return c.peer if c is not None else ""

    # -- jobs ------------------------------------------------------------------------------
    def run_enable(self, unit_id: str, *, kind: str, members: list, peer: str, interval: int,
                   start_time: float | None = None, bandwidth_limit: int = 0, retention: str = "",
                   verify_interval: int | None = None) -> dict:
        st = unit_state.find_state(self.pool, unit_id)
        if st is not None and st.role != "primary":
            return {"role": st.role}                 # replication exists here as a replica
        unit_state.ensure_unit(self.pool, unit_id, members, kind=kind, role="primary", peer=peer)
        with control_lock(self.pool, unit_id):
            c = find_control(self.pool, unit_id) or Control(unit_id=unit_id, kind=kind, members=members,
                                                             peer=peer, enabled_at=time.time())
            c.peer, c.interval, c.start_time, c.bandwidth_limit = peer, interval, start_time, bandwidth_limit
            c.members, c.retention, c.verify_interval = members, retention, verify_interval
            save_control(self.pool, c)
        task = self.dispatcher.submit("sync", unit_id, {"trigger": "initial"})
        log.info("replication of %s %s to %s enabled every %ss; initial sync queued (%s)",
                 kind, unit_id, peer, interval, task)
        return {"initial_sync_task": task}

    def run_sync(self, unit_id: str, *, trigger: str = "schedule", scheduled_at: float | None = None) -> dict:
        delay = max(0.0, time.time() - scheduled_at) if scheduled_at else None
        c = find_control(self.pool, unit_id)
        st = unit_state.find_state(self.pool, unit_id)
        if c is None or st is None:
            return {"skipped": "replication is not enabled"}
        if st.role != "primary":
            return {"skipped": f"{st.role} on this site"}
        return self._sync(c, demote=False, delay=delay)

    def _sync(self, c: Control, *, demote: bool, delay: float | None = None) -> dict:
        from ..sender.sync import sync_unit
        members = self._members(c)
        t0 = time.time()
        peer = None
        try:
            peer = self.peers(c.peer)
            cut = self._cut(c, demote=demote)
            ships = shipped_snapshots.candidates(self.volumes, c.kind, members) if cut is None else []
            for ship in shipped_snapshots.pending(ships, c.snapshots_shipped):
                # a CSI snapshot first, as a generation of its own: a pinned point at the peer
                sync_unit(self.pool, c.unit_id, members, peer, kind=c.kind, bandwidth=self._limiter(c),
                          origin=self._origin(c, ships, ship.point), sources=ship.sources)
                self._shipped(c, ship.snapshot_id, ships)
            # a worker lives on: the base rolls forward behind the return, off the sync's time
            report = sync_unit(self.pool, c.unit_id, members, peer, mounts=self._mounts(members),
                               demote=demote, kind=c.kind, bandwidth=self._limiter(c),
                               origin=self._origin(c, ships), cut=cut, roll_behind=True)
        except OperationInProgress:
            raise
        except SplitBrain as e:
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
            ctl.sent_bytes_total += int(r["bytes_on_wire"])
            ctl.changed_bytes_total += int(r["bytes_changed"])
            if delay is not None:
                ctl.last_sync_delay = round(delay, 3)
        update_control(self.pool, c.unit_id, ok)
        log.info("synced %s: generation %s -> %s, %d bytes on the wire in %.3fs (%s)", c.unit_id,
                 r["base_generation"], r["target_generation"], r["bytes_on_wire"], r["duration_s"], r["mode"])
        out = {k: r[k] for k in ("base_generation", "target_generation", "bytes_on_wire", "bytes_changed",
                                 "duration_s", "mode", "records", "resumed")}
        if delay is not None:
            out["scheduling_delay_s"] = round(delay, 3)
        return out

    def _shipped(self, c: Control, snapshot_id: str, ships) -> None:
        """The peer holds *snapshot_id* as a point; forget the ones this site no longer has."""
        have = {s.snapshot_id for s in ships}

        def mark(ctl: Control):
            ctl.snapshots_shipped = sorted((set(ctl.snapshots_shipped) & have) | {snapshot_id})
        c.snapshots_shipped = sorted((set(c.snapshots_shipped) & have) | {snapshot_id})
        update_control(self.pool, c.unit_id, mark)

    def _record_failure(self, unit_id: str, t0: float, message: str, *, conflict: str = "") -> None:
        def bad(ctl: Control):
            ctl.last_attempt, ctl.last_error = t0, message
            ctl.consecutive_failures += 1
            ctl.failures_total += 1
            ctl.conflict = conflict
        update_control(self.pool, unit_id, bad)
        log.warning("sync of %s failed: %s", unit_id, message)

    def _one_role_change(self, unit_id: str):
        """One promote, demote or resync of a unit at a time on this node. Two copies of one
        task can run at once: a message published again as Redis restarts, or redelivered
        while its first copy still runs. Both would find the unit as it was and act on it (a
        promote twice: two epochs). The second copy waits here, then finds the work done."""
        unit_state.get_state(self.pool, unit_id)          # NotEnabled before any lock file
        return store.file_lock(PoolLayout(self.pool).role_lock_path(unit_id), key=unit_id,
                               wait=min(60.0, self.cfg.visibility_timeout / 2))

    def run_demote(self, unit_id: str, *, force: bool = False) -> dict:
        with self._one_role_change(unit_id):
            return self._demote(unit_id)

    def _demote(self, unit_id: str) -> dict:
        c = find_control(self.pool, unit_id)
        st = unit_state.get_state(self.pool, unit_id)
        if st.role == "secondary":
            return {"role": "secondary"}
        try:
            with self._site_bandwidth().priority(c.unit_id, c.peer):
                out = self._final_sync(c)
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

    def _final_sync(self, c: Control) -> dict:
        """A Demote's final sync, under the priority its caller holds. A sync of the unit that is
        running holds the unit's lock: it has the priority too (the lease names the unit), and
        the final sync waits for it, up to half the visibility timeout (at most a minute; then
        OperationInProgress, ABORTED, and the CO's retry joins). Syncs queued for later find
        the unit secondary and skip.

        A part of a group spanning nodes whose cut was not met (``NotGroupConsistent``:
        another part did not freeze within the cut's wait, as when it waits for its own
        running sync) cut nothing, and tries again within the same deadline: the other part
        retries too, and they meet. Giving up there would demote without a final sync, and
        turn a planned failover into a forced one."""
        deadline = time.monotonic() + min(60.0, self.cfg.visibility_timeout / 2)
        while True:
            try:
                return self._sync(c, demote=True)
            except OperationInProgress:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
            except NotGroupConsistent as e:
                if time.monotonic() >= deadline:
                    raise
                log.info("final sync of %s: %s; trying the cut again", c.unit_id, e.message)

    def run_promote(self, unit_id: str, *, force: bool = False, point: int | None = None) -> dict:
        with self._one_role_change(unit_id):
            return self._promote(unit_id, force=force, point=point)

    def run_promote_all(self, batch: str, *, units: list, force: bool = False) -> dict:
        """Promote *units* of this node, PROMOTE_THREADS at a time (a site failover): one task
        for the batch instead of one per unit. Each unit is promoted as ``run_promote`` does,
        under its own role lock, so a unit promoted already (by this batch sent twice, or by
        a PromoteVolume of its own) is answered as it is, never promoted twice. *batch* names
        the batch's claim; the per-unit results carry each failure by its error's name."""
        def promote(unit_id: str) -> dict:
            before = unit_state.get_state(self.pool, unit_id).role
            out = self.run_promote(unit_id, force=force)
            return {"result": "primary" if before == "primary" else "promoted", "epoch": out["epoch"]}
        return self._batch(batch, units, "promote",
                           lambda unit_id: batch_row("promote", batch, unit_id, lambda: promote(unit_id)))

    def run_demote_all(self, batch: str, *, units: list, resync: bool = False) -> dict:
        """Demote *units* of this node, PROMOTE_THREADS at a time (a site's failback, or the
        first half of a planned site failover): each as ``run_demote`` does, under its own
        role lock, so a unit found secondary already is answered as it is. With *resync*,
        each is then resynced with force (``run_resync``): the peer, asked for its next sync
        now, ships what diverged. The per-unit results carry each failure by its error's name."""
        def demote(unit_id: str) -> dict:
            out = self.run_demote(unit_id)
            if "final_sync" not in out:
                return {"result": "secondary", "final_sync": False}
            return {"result": "demoted", "final_sync": out["final_sync"] is not None}

        def resynced(unit_id: str) -> dict:
            return {"resync": "ready" if self.run_resync(unit_id, force=True).get("ready") else "requested"}

        def one(unit_id: str) -> dict:
            row = batch_row("demote", batch, unit_id, lambda: demote(unit_id))
            if resync and row["result"] != "failed":
                done = batch_row("resync", batch, unit_id, lambda: resynced(unit_id))
                if done.pop("result", "") == "failed":      # the demote's own result stands
                    done["resync"] = "failed"
                row.update(done)
            return row
        return self._batch(batch, units, "demote", one)

    @staticmethod
    def _batch(batch: str, units: list, name: str, one: Callable[[str], dict]) -> dict:
        """*one* over *units*, PROMOTE_THREADS at a time: a row per unit, with its seconds."""
        from concurrent.futures import ThreadPoolExecutor

        def timed(unit_id: str) -> dict:
            t0 = time.monotonic()
            return {"unit_id": unit_id, **one(unit_id), "seconds": round(time.monotonic() - t0, 4)}
        with ThreadPoolExecutor(max_workers=PROMOTE_THREADS, thread_name_prefix=f"drsvc-{name}") as pool:
            return {"batch": batch, "results": list(pool.map(timed, units))}

    def _promote(self, unit_id: str, *, force: bool, point: int | None) -> dict:
        from ..points.restore import take_over
        from .takeover import seed_base
        st = unit_state.get_state(self.pool, unit_id)
        if st.role == "primary":
            return {"role": "primary", "epoch": st.epoch}
        if not force:
            # a replica known bad first: it is the reason a planned promote would be wrong too
            refuse_known_bad(self.pool, st, point, action="promote")
            if st.peer_demoted_at is None or st.peer_demoted_at != st.generation:
                raise PeerNotDemoted(
                    f"the peer has not demoted {unit_id} at this site's generation {st.generation}"
                    + (f" (it demoted at {st.peer_demoted_at})" if st.peer_demoted_at is not None else "")
                    + "; demote it first, or promote with force", unit_id=unit_id, generation=st.generation)
            if st.diverged or st.resync_requested:
                raise NeedsResync(unit_id=unit_id)
        c = find_control(self.pool, unit_id) or control_from_origin(st)
        if c is None:
            raise PeerNotRecorded(unit_id=unit_id)
        self._drop_unsettled(unit_id)
        # the received images become the acked base, so the next sync ships only changes
        base = seed_base(self.pool, unit_id)
        # recovery points: the newest gets an image of its own; with a point, its data becomes the volumes'
        restored = take_over(self.pool, unit_id, point)
        final = None if force else final_sync(st)     # planned: the demote's final sync is our last sync
        st = unit_state.promote(self.pool, unit_id)
        ReplicaMaps(PoolLayout(self.pool), unit_id).discard()    # this site no longer receives
        with control_lock(self.pool, unit_id):
            c.enabled_at = time.time()
            # the last sync this site reports is one of this term: the demote's final sync, which
            # left both copies equal, or none (NOT_FOUND until the first) — a record kept from an
            # earlier term here is older than what the peer shipped since
            c.last_sync_time, c.last_sync_duration, c.last_sync_bytes = final or (0.0, 0.0, 0)
            c.last_sync_delay = 0.0
            if final is not None:
                c.enabled_at = final[0]
            c.conflict, c.consecutive_failures = "", 0
            save_control(self.pool, c)
        log.info("promoted %s to primary at epoch %d (%s; base %s)", unit_id, st.epoch,
                 "forced" if force else "planned", f"block maps from the {base}" if base else "kept")
        return {"role": "primary", "epoch": st.epoch, **({"recovery_point": restored} if restored else {})}

    def _drop_unsettled(self, unit_id: str) -> None:
        """A round of a spanning group still prepared here (the site controller settles
        rounds across the nodes before it promotes; a promote on this node alone has no
        other node to ask): taking over without it keeps the generation every node applied."""
        from ..receiver.replica import round_state, settle_round
        layout = PoolLayout(self.pool)
        p = round_state(layout, unit_id)["prepared"]
        if p is not None:
            settle_round(layout, unit_id, p["txid"], False)
            log.warning("promote of %s: dropped generation %s of round %s, prepared but never decided",
                        unit_id, p["target"], p["round"])

    def run_resync(self, unit_id: str, *, force: bool = False) -> dict:
        with self._one_role_change(unit_id):
            return self._resync(unit_id, force=force)

    def _resync(self, unit_id: str, *, force: bool) -> dict:
        st = unit_state.get_state(self.pool, unit_id)
        if st.role != "secondary":
            raise NotSecondary(kind="unit", unit_id=unit_id)
        from .consistency import resync_step
        c = find_control(self.pool, unit_id) or control_from_origin(st)
        if c is None:
            return {"ready": False, "reason": "no record of the primary's site"}
        return resync_step(self.pool, unit_id, force=force, open_peer=lambda: self.peers(c.peer))

    def run_verify(self, unit_id: str, *, repair: bool = False, trigger: str = "demand") -> dict:
        """Verify (scrub) the replica held here; with *repair* (or the site's verify_repair on a
        scheduled run), mismatches ask the primary to re-send them: by name with its next delta
        when they are few (``scrub_plan.REPAIR_RUNS``), else by a compare sync."""
        from .consistency import ask_primary_soon
        from .scrub import Scrub
        st = unit_state.get_state(self.pool, unit_id)
        if st.role != "secondary":
            return {"skipped": f"{st.role} on this site: a verify reads a replica (run it at the secondary)"}
        c = find_control(self.pool, unit_id) or control_from_origin(st)
        if c is None:
            raise PeerNotRecorded(unit_id=unit_id)
        run = Scrub(self.pool, unit_id, lambda: self.peers(c.peer), read_rate=self.cfg.verify_read_rate).run()
        runs = run.pop("repair_runs")
        record = VerifyRecord.find(self.pool, unit_id)
        record.add(run)
        repair = repair or (trigger == "schedule" and self.cfg.verify_repair)
        if (run["points"] or {}).get("damaged_points"):
            log.warning("verify of %s: recovery point(s) %s damaged (first %s); they cannot be repaired from "
                        "the primary", unit_id, run["points"]["damaged_points"], run["points"]["damaged"][:3])
        if run["mismatched_blocks"]:
            log.warning("verify of %s: %d block(s) of generation %d differ (first %s)", unit_id,
                        run["mismatched_blocks"], run["generation"], run["mismatches"][:3])
            if repair:
                # the runs by name when they are few: the next delta carries them; else the
                # next sync is a compare sync, which diffs every block of the copy
                if runs is not None:
                    unit_state.request_repair(self.pool, unit_id, run["generation"], runs)
                else:
                    unit_state.request_resync(self.pool, unit_id)
                record.ask_repair(by="delta" if runs is not None else "compare")
                ask_primary_soon(lambda: self.peers(c.peer), unit_id)
                log.info("verify of %s: repair asked for (the primary's next sync %s)", unit_id,
                         "re-sends the blocks" if runs is not None else "compares")
        else:
            log.info("verify of %s at generation %d: %s, %d bytes read in %.1fs", unit_id, run["generation"],
                     run["result"], run["bytes_read"], run["duration_s"])
        return {**run, "repair_requested": bool(repair and run["mismatched_blocks"])}

    def run_disable(self, unit_id: str) -> dict:
        from ..sender.base_store import release_unit
        from ..sender.receiver_client import release_peer
        c = find_control(self.pool, unit_id)
        st = unit_state.find_state(self.pool, unit_id)
        peer_released = None
        if c is not None and st is not None and st.role == "primary":
            peer = None
            try:
                peer = self.peers(c.peer)
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
        remove_control(self.pool, unit_id)
        return {"peer_released": peer_released}
