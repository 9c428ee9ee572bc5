"""``sync_unit``: replicate one volume or group to its peer. The composition point of the sender.

It checks the call, takes the unit's lock and hands the driver a :class:`SyncPlanner`
(this site's snapshot store and state, ``reconcile.reconcile``, the step objects) and
a session opener (``receiver_client.ApplySession`` over the peer's transport).

Every step is safe to repeat. The order of side effects makes a retry converge:

1. capture + plan into ``snap/tmp-<txid>/`` (ours alone; swept at the next sync);
2. rename it to ``snap/<target>/``: the intent, "this generation may be on the wire";
3. stream it; the peer journals, commits and applies it;
4. record the result: state.json says generation = target; drop the old base.

A sync that finds ``snap/<target>/`` left by a failed run asks the peer: if the
peer committed that txid the generation is adopted (finalize); if not, it is
resumed (same snapshot, same plan, skipping what the peer already journaled).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ... import store
from ...errors import InvalidParameter, NotPrimary, StaleEpoch
from ...host.freeze import MountsHeld, no_mounts
from ...layout import PoolLayout, check_id
from ...transport import LinkHints
from ...transport.bandwidth import Bandwidth, TokenBucket, combine
from ..common.blockmap import DEFAULT_BLOCK_SIZE, check_block_size
from ..common.unit_state import UnitState, find_state
from .base_store import load_pending, sweep
from .driver import Attempt, Job, drive
from .generation import Prepared
from .group_rounds import Cut
from .prepare import replan
from .receiver_client import ApplySession
from .reconcile import Pending, reconcile
from .reports import SyncReport
from .steps import Step, plan_steps, prepare_delta

MODES = ("delta", "compare")


class SyncPlanner:
    """The driver's planner over this site's pool (``driver.Planner``)."""

    def __init__(self, load_state: Callable[[], UnitState]):
        self.load_state = load_state

    def load(self, job: Job) -> tuple[UnitState, Prepared | None]:
        st = self.load_state()
        pending = load_pending(job.layout, job.unit_id, st.generation) or replan(job.layout, st)
        sweep(job.layout, job.unit_id, st.generation, pending)
        return st, pending

    def ahead(self, a: Attempt) -> None:
        """Capture the next generation and start its plan; a one flight sends its records
        as the plan finds them (``Ship``), any other step waits for the plan first."""
        if a.pending is None and a.job.mode == "delta":
            a.early = prepare_delta(a, pipelined=a.job.cut is None)

    def plan(self, a: Attempt) -> list[Step]:
        job = a.job
        jr = a.peer_st.get("journal") or {}
        if jr.get("prepared"):
            # a round of a group spanning nodes was left prepared there: its decision, taken once
            # at this site (none recorded: abort), is what the planner settles it with
            jr["decision"] = job.cut.decision(jr.get("round")) if job.cut is not None and jr.get("round") else False
        pend = a.pending and Pending(a.pending.meta["generation"], a.pending.meta["txid"],
                                     tuple(m["volume_id"] for m in a.pending.meta["members"]))
        return plan_steps(reconcile(job.unit_id, a.st.generation, pend, a.peer_st, job.members, job.mode))

    def flight(self, a: Attempt) -> list[Step] | None:
        """A fresh generation sent without asking first: what ``reconcile`` plans when the
        peer is at our acked generation, which the transaction's ``begin`` checks there."""
        if a.pending is not None or a.job.mode != "delta" or a.job.cut is not None:
            return None
        return plan_steps(["sync"])


def open_apply_session(job: Job) -> ApplySession:
    """The default session opener: one `apply` conversation on a (warm) receiver."""
    return ApplySession(job.peer, job.unit_id, bandwidth=job.bandwidth)


def sync_unit(pool, unit_id: str, members, peer, *, mounts: MountsHeld = no_mounts, epoch: int | None = None,
              demote: bool = False, mode: str = "delta", kind: str | None = None,
              block_size: int | None = None, bwlimit: float | None = None,
              compress: str = "auto", origin: dict | None = None, attempts: int = 1,
              cut: Cut | None = None, bandwidth: Bandwidth | None = None,
              link: LinkHints | None = None, sources: dict | None = None,
              roll_behind: bool = False) -> SyncReport:
    """Replicate one volume or group to *peer* and return the report (also kept in state.json).

    members: the volume ids of the unit (one for a volume unit). mounts: holds the
    members' mounted filesystems (to write back and freeze) during the capture and yields
    their mountpoints (``NodeService.mounts_held``). epoch: the fencing epoch (None:
    the unit's). demote: carry a planned-failover demotion mark and make this
    site secondary once the peer commits. mode "compare": diff against the
    peer's block hashes instead of our acked snapshot (resync after split brain).
    attempts: how many times to plan and run again after a lost connection.
    cut: this unit is one node's part of a group spanning storage nodes
    (``group_rounds``): captures meet the other parts, commits are two-phase.
    sources: volume id -> a file to capture instead of the live image (a CSI snapshot
    shipped as a recovery point, named in ``origin["point"]``).
    bandwidth: the limiter everything this sync sends goes through (``transport.bandwidth``;
    the worker's jobs give the unit's and the site's limits in one); bwlimit, bytes per
    second, adds a bucket of this call's own in front of it.
    link: striping hints (how many channels a large generation takes; None: ``peer.link``).
    roll_behind: return once the generation is recorded, and roll the base forward on a
    thread of this process (``base_store.roll_behind``): for a long-lived caller, as a worker
    is. The unit's lock is free at the return; the next reader of the base waits for the roll.
    """
    if mode not in MODES:
        raise InvalidParameter(key="mode", reason=f"must be one of {MODES}")
    if compress not in ("auto", "off", "always"):
        raise InvalidParameter(key="compress", reason="auto, off or always")
    layout = PoolLayout(pool)
    check_id(unit_id)
    members = [check_id(m, "volume id") for m in members]
    if not members or len(set(members)) != len(members):
        raise InvalidParameter(key="members", reason="one or more distinct volume ids")
    layout.ensure_unit_dir(unit_id)
    layout.snap_root(unit_id).mkdir(exist_ok=True)
    report = SyncReport(unit_id=unit_id, mode=mode, started_at=time.time(), members=list(members))
    t0 = time.monotonic()
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        st = _primary_state(pool, unit_id, members, kind=kind, epoch=epoch, block_size=block_size)
        report.epoch = epoch = st.epoch if epoch is None else epoch
        job = Job(layout, unit_id, members, peer, mounts=mounts, epoch=epoch,
                  demote=demote, mode=mode, compress=compress, origin=origin, cut=cut, link=link,
                  roll_behind=roll_behind,
                  bandwidth=combine(TokenBucket(bwlimit) if bwlimit else None, bandwidth), sources=sources)
        planner = SyncPlanner(lambda: _primary_state(pool, unit_id, members, kind=kind, epoch=epoch,
                                                     block_size=block_size))
        drive(job, planner, open_apply_session, report, attempts=attempts)
    report.duration_s = time.monotonic() - t0
    return report


def _primary_state(pool, unit_id, members, *, kind, epoch, block_size) -> UnitState:
    """The unit's state, checked: this site is primary and *epoch* is not stale."""
    st = find_state(pool, unit_id)
    if st is None:
        st = UnitState(unit_id=unit_id, members=list(members), role="primary",
                       kind=kind or ("volume" if members == [unit_id] else "group"),
                       block_size=check_block_size(block_size or DEFAULT_BLOCK_SIZE))
    elif kind:
        st.kind = kind
    if st.role != "primary":
        raise NotPrimary(unit_id=unit_id, role=st.role)
    if epoch is not None and epoch < st.epoch:
        raise StaleEpoch(unit_id=unit_id, epoch=epoch, have=st.epoch)
    if st.generation == 0 and block_size:
        st.block_size = check_block_size(block_size)
    return st
