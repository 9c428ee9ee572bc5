"""Steps of one sync: small objects with ``run(attempt)`` and their part of the report.

``reconcile.reconcile`` names the steps (pure); ``plan_steps`` turns the names into
objects (``driver.Step``). A step that leaves a generation to send (``ships``) is
followed by ``Ship``. Adding a step: write a class with a ``name``, ``run()`` (and
``ships`` when it prepares a generation), decorate it with ``@register``, and let
``reconcile`` name it. The driver never changes.

Steps work through the rooms below them: ``prepare`` (capture + plan),
``stream`` (send a generation over the attempt's session) and ``base_store``
(intent, adopt).
"""
from __future__ import annotations

import logging
import shutil
import time
import uuid

from ... import store
from ...errors import PeerUnreachable, RoundAborted
from ...failpoints import failpoint
from ...transport.bandwidth import rate_of
from .base_store import Preroll, adopt, mark_intent
from .driver import Attempt, Job, Refused
from .generation import Prepared
from .group_rounds import abandon
from .prepare import prepare
from .progress import progress_path
from .stream import stream
from .striping import one_channel, stated_rate

log = logging.getLogger(__name__)


def prepare_for(a: Attempt, **kw) -> Prepared:
    """Capture and plan a generation of the attempt's unit (``prepare.prepare``)."""
    j = a.job
    return prepare(j.layout, a.st, j.members, mounts=j.mounts, bs=a.st.block_size, cut=j.cut,
                   sources=j.sources, **kw)


def prepare_delta(a: Attempt, *, pipelined: bool = False, repair: dict | None = None) -> Prepared:
    """The next generation, planned against the acked base (pipelined: still planning when
    returned, ``prepare.prepare``); *repair*: the peer's repair request, whose block runs it
    re-sends too."""
    j = a.job
    return prepare_for(a, txid=uuid.uuid4().hex, target=a.st.generation + 1,
                       base_generation=a.st.generation, mode="delta", pipelined=pipelined, repair=repair,
                       wire_rate=wire_rate(j) if pipelined else 0.0,
                       one_channel=lambda planned: one_channel(planned, rtt=j.peer.rtt(), link=j.link or j.peer.link,
                                                               bwlimit=rate_of(j.bandwidth)))


def wire_rate(j: Job) -> float:
    """The rate the config says the sync's records cross the link at (bytes/s; 0: unknown):
    the peer's ``link_rate``, else the sync's bandwidth limit, as stripes are sized."""
    return stated_rate(j.link or j.peer.link, rate_of(j.bandwidth))


class Step:
    """The base of the step objects (``driver.Step``)."""
    name = "?"
    ships = False       # leaves a generation in attempt.prepared for Ship
    reported = True

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
        repair = a.peer_st.get("repair") if a.peer_st else None
        if repair:           # the blocks a verify there found go too: a plan that names them
            a.drop_early()
            a.prepared = prepare_delta(a, repair=repair)
            a.report.repair = True
            return
        a.prepared, a.early = a.early or prepare_delta(a), None


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
            a.prepared = prepare_for(a, txid=txid, target=max(a.st.generation, peer_gen) + 1,
                                     base_generation=peer_gen, mode="compare", peer_maps=maps)
        finally:
            shutil.rmtree(maps_dir, ignore_errors=True)


class Ship(Step):
    """Intent (rename to snap/<G+1>), stream, commit at the peer, adopt.

    For one node's part of a group spanning nodes the commit is two-phase: the peer
    prepares, the round is decided by every part's vote (``Job.cut``), the decision
    goes to the peer, and only a committed round is adopted."""
    name = "ship"
    reported = False

    def run(self, a: Attempt) -> None:
        j, prepared = a.job, a.prepared
        meta = prepared.meta
        rid = meta.get("round")
        if j.cut is not None and (not rid or a.report.resumed):
            # a round whose stream broke was aborted (fail() below, or the others' vote timed out)
            self._drop(a, prepared, "cut this generation with it" if not rid else "finished its last round")
        a.report.mode = meta["mode"]           # the planner may have switched to compare
        if prepared.planning is not None and not a.one_flight:
            prepared.settle()        # only a one flight sends records while the plan still reads
        # it may now exist at the peer (a generation still planning holds its intent already)
        a.prepared = mark_intent(j.layout, j.unit_id, prepared)
        # the base's roll forward while the peer commits (``base_store.Preroll``): started at the
        # trailer, once every record is out, as beside the send its reflinks slow the send's
        # reads of the overlay (and a plan's, still reading)
        rolling = Preroll(j.layout, j.unit_id, a.prepared.dir, meta)
        try:
            self._send(a, at_trailer=rolling.start)
        except BaseException:
            rolling.join()
            if a.prepared is not None:
                abandon(j.cut, rid)      # the others need not wait for a vote that will not come
            raise
        prepared = a.prepared
        a.report.phases["prepare_s"] = round(meta.get("capture_s", 0) + meta.get("plan_s", 0), 4)
        if j.cut is not None:
            failpoint("sender.after_prepare")
            t = time.monotonic()
            try:
                commit = j.cut.vote(rid)
            finally:
                rolling.join()
            a.report.phases["vote_s"] = round(time.monotonic() - t, 4)
            failpoint("sender.after_vote")
            a.session.decide(meta["txid"], commit)
            if not commit:
                self._drop(a, prepared, "did not prepare it in time")
        behind = j.roll_behind and not j.demote
        t = time.monotonic()
        if not behind:
            rolling.join()
            # preroll_s: the base's roll forward, beside the stream; roll_wait_s: what of it was not
            a.report.phases["preroll_s"] = round(rolling.seconds, 4)
        a.report.phases["roll_wait_s"] = round(time.monotonic() - t, 4)
        failpoint("sender.after_commit")
        a.report.duration_s = time.monotonic() - a.t0
        t = time.monotonic()
        adopt(j.layout, a.st, prepared, epoch=j.epoch, peer_name=j.peer.name, demote=j.demote,
              report=a.report_so_far(), behind=rolling if behind else None)
        a.report.phases["adopt_s"] = round(time.monotonic() - t, 4)
        a.prepared = None

    def _send(self, a: Attempt, *, at_trailer) -> None:
        """Stream ``a.prepared``; on a failure, leave it as the next attempt needs it.
        *at_trailer* runs once every record is out and its plan is whole, before the trailer."""
        j = a.job
        prepared = a.prepared

        def before_trailer():
            prepared.settle()
            at_trailer()
        try:
            stream(a.session, a.prepared, a.report, unit_id=j.unit_id, epoch=j.epoch, demote=j.demote,
                   kind=a.st.kind, compress=j.compress, origin=j.origin,
                   progress_path=progress_path(j.layout.root, j.unit_id), two_phase=j.cut is not None,
                   one_flight=a.one_flight, link=j.link, bwlimit=rate_of(j.bandwidth),
                   before_trailer=before_trailer)
        except Refused:
            # refused before the peer journaled anything: the generation is not there. It is as
            # fresh as an early capture, and planned for as one (dropped unless a step takes it)
            refused, a.prepared = a.prepared, None
            if self._finish_plan(a, refused):
                a.early = refused
            raise
        except PeerUnreachable:
            # what landed at the peer is journaled for this txid: let the plan finish, so the
            # next attempt resumes it at once (a plan stopped is written again there first)
            self._finish_plan(a, a.prepared)
            raise
        except BaseException:
            a.prepared.stop()        # nothing will send the rest of it now (the next sync plans it again)
            raise

    @staticmethod
    def _finish_plan(a: Attempt, prepared: Prepared) -> bool:
        """Wait for a plan the stream stopped reading; False (and the generation dropped)
        when it failed."""
        try:
            prepared.settle()
            return True
        except Exception as e:   # noqa: BLE001 - the stream's error is the one raised
            log.warning("sync of %s: the plan of the generation being sent failed (%s); dropped",
                        a.job.unit_id, e)
            shutil.rmtree(prepared.dir, ignore_errors=True)
            return False

    @staticmethod
    def _drop(a: Attempt, prepared: Prepared, why: str) -> None:
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
