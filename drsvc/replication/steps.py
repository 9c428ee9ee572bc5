"""Steps of one sync: small objects with ``run(attempt)`` and their part of the report.

``plan.reconcile`` names the steps (pure); ``plan_steps`` turns the names into
objects. A step that leaves a generation to send (``ships``) is followed by
``Ship``. Adding a step: write a class with a ``name``, ``run()`` (and ``ships``
when it prepares a generation), decorate it with ``@register``, and let
``reconcile`` name it. The driver never changes.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass, field

from .. import store
from ..errors import RoundAborted
from . import health
from .faults import failpoint
from .layout import PoolLayout
from .report import SyncReport
from .state import UnitState


@dataclass
class Job:
    """What one sync_unit call asks for; the same for every attempt."""
    layout: PoolLayout
    unit_id: str
    members: list
    peer: object
    mountpoints: tuple = ()
    epoch: int = 0
    demote: bool = False
    mode: str = "delta"
    compress: str = "auto"
    bwlimit: float | None = None
    origin: dict | None = None
    cut: object = None            # replication.cut.Cut: one node's part of a group spanning nodes
    sources: dict | None = None   # volume id -> file captured instead of the live image (a CSI snapshot)


@dataclass
class Attempt:
    """What the steps of one attempt hand to each other."""
    job: Job
    st: UnitState
    report: SyncReport
    session: object = None        # remote.ApplySession, open for the whole attempt
    peer_st: dict = field(default_factory=dict)
    pending: object = None        # sender.Prepared: snap/<G+1> left by an earlier run
    early: object = None          # sender.Prepared captured while connecting (against G)
    prepared: object = None       # what Ship sends
    t0: float = field(default_factory=time.monotonic)   # start of the sync

    def drop_early(self) -> None:
        if self.early is not None:
            shutil.rmtree(self.early.dir, ignore_errors=True)
            self.early = None

    def prepare(self, **kw):
        from .sender import prepare
        j = self.job
        return prepare(j.layout, self.st, j.members, mountpoints=j.mountpoints,
                       bs=self.st.block_size, cut=j.cut, sources=j.sources, **kw)

    def prepare_delta(self):
        return self.prepare(txid=uuid.uuid4().hex, target=self.st.generation + 1,
                            base_generation=self.st.generation, mode="delta")


class Step:
    name = "?"
    ships = False       # leaves a generation in attempt.prepared for Ship

    def run(self, a: Attempt) -> None:
        raise NotImplementedError


STEPS: dict[str, type[Step]] = {}


def register(cls: type[Step]) -> type[Step]:
    STEPS[cls.name] = cls
    return cls


@register
class Finalize(Step):
    """The peer committed our pending generation: adopt it as the new base."""
    name = "finalize"

    def run(self, a: Attempt) -> None:
        from .sender import adopt
        adopt(a.job.layout, a.st, a.pending, epoch=a.job.epoch, peer_name=a.job.peer.name)
        a.pending = None
        a.drop_early()          # it was planned against the old base


@register
class Settle(Step):
    """The peer holds a prepared generation of a round (a group spanning nodes): carry the
    round's decision to it (read while connecting). Finalize or Discard follows for our
    pending copy of it, as the planner saw the decision."""
    name = "settle"

    def run(self, a: Attempt) -> None:
        jr = a.peer_st["journal"]
        a.session.decide(jr["txid"], bool(jr.get("decision")))


@register
class Discard(Step):
    """Drop a pending generation the peer will never commit."""
    name = "discard"

    def run(self, a: Attempt) -> None:
        shutil.rmtree(a.pending.dir)
        store.fsync_dir(a.pending.dir.parent)
        a.pending = None


@register
class Resume(Step):
    """Send the pending generation again; the peer keeps the records it journaled."""
    name = "resume"
    ships = True

    def run(self, a: Attempt) -> None:
        a.prepared, a.pending = a.pending, None
        a.report.resumed = True


@register
class Sync(Step):
    """Capture and plan a new generation against the acked base (or take the early one)."""
    name = "sync"
    ships = True

    def run(self, a: Attempt) -> None:
        a.prepared, a.early = a.early or a.prepare_delta(), None


@register
class Compare(Step):
    """Plan against the peer's block hashes instead of our acked base."""
    name = "compare"
    ships = True

    def run(self, a: Attempt) -> None:
        a.drop_early()
        txid = uuid.uuid4().hex
        maps_dir = a.job.layout.snap_root(a.job.unit_id) / f"tmp-maps-{txid}"
        maps_dir.mkdir()
        try:
            maps = a.session.fetch_maps(a.job.members, a.st.block_size, maps_dir)
            peer_gen = int(a.peer_st.get("generation") or 0)
            a.prepared = a.prepare(txid=txid, target=max(a.st.generation, peer_gen) + 1,
                                   base_generation=peer_gen, mode="compare", peer_maps=maps)
        finally:
            shutil.rmtree(maps_dir, ignore_errors=True)


class Ship(Step):
    """Intent (rename to snap/<G+1>), stream, commit at the peer, adopt.

    For one node's part of a group spanning nodes the commit is two-phase: the peer
    prepares, the round is decided by every part's vote (``Job.cut``), the decision
    goes to the peer, and only a committed round is adopted."""
    name = "ship"

    def run(self, a: Attempt) -> None:
        from .sender import Prepared, adopt, stream
        j, prepared = a.job, a.prepared
        meta = prepared.meta
        rid = meta.get("round")
        if j.cut is not None and (not rid or a.report.resumed):
            # a round whose stream broke was aborted (fail() below, or the others' vote timed out)
            self._drop(a, prepared, "cut this generation with it" if not rid else "finished its last round")
        a.report.mode = meta["mode"]           # the planner may have switched to compare
        a.report.phases["prepare_s"] = round(meta.get("capture_s", 0) + meta.get("plan_s", 0), 4)
        if prepared.dir.name != str(meta["generation"]):
            final = j.layout.snap_dir(j.unit_id, meta["generation"])
            if final.exists():
                shutil.rmtree(final)
            os.rename(prepared.dir, final)     # from here on this generation may exist at the peer
            store.fsync_dir(final.parent)
            a.prepared = prepared = Prepared(final, meta)
        try:
            stream(a.session, prepared, a.report, unit_id=j.unit_id, epoch=j.epoch, demote=j.demote,
                   kind=a.st.kind, peer_name=j.peer.name, compress=j.compress, origin=j.origin,
                   progress_path=health.progress_path(j.layout.root, j.unit_id), two_phase=j.cut is not None)
        except BaseException:
            if j.cut is not None:
                j.cut.fail(rid)      # the others need not wait for a vote that will not come
            raise
        if j.cut is not None:
            failpoint("sender.after_prepare")
            t = time.monotonic()
            commit = j.cut.vote(rid)
            a.report.phases["vote_s"] = round(time.monotonic() - t, 4)
            failpoint("sender.after_vote")
            a.session.decide(meta["txid"], commit)
            if not commit:
                self._drop(a, prepared, "did not prepare it in time")
        failpoint("sender.after_commit")
        a.report.duration_s = time.monotonic() - a.t0
        t = time.monotonic()
        adopt(j.layout, a.st, prepared, epoch=j.epoch, peer_name=j.peer.name, demote=j.demote,
              report=a.report.to_dict())
        a.report.phases["adopt_s"] = round(time.monotonic() - t, 4)
        a.prepared = None

    @staticmethod
    def _drop(a: Attempt, prepared, why: str) -> None:
        """An aborted round: its generation is dropped here, as at the peer."""
        shutil.rmtree(prepared.dir, ignore_errors=True)
        store.fsync_dir(prepared.dir.parent)
        a.prepared = None
        raise RoundAborted(unit_id=a.job.unit_id, reason=why)


def plan_steps(names) -> list[Step]:
    steps = [STEPS[n]() for n in names]
    if any(s.ships for s in steps):
        steps.append(Ship())
    return steps
