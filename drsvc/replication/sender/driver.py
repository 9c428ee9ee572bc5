"""The sync driver: plan -> steps -> report, and a new plan after a temporary failure.

Each attempt reads this end's state, opens a session to the peer and reads its
status, asks the planner for the steps and runs them in order. A failure of
the connection (``PeerUnreachable``) ends the attempt; the next attempt plans
again from what is on disk and at the peer (a generation left pending is
finalized or resumed, never sent twice). Other errors are final. Every attempt
is recorded in ``report.attempts``; the session is closed on every path.

The driver knows only the interfaces declared here, as zrepl's
``replication/driver`` does: a :class:`Planner`, a :class:`SessionOpener` and
its :class:`Session`, and :class:`Step` objects. The implementations import
this module, never the reverse: ``sync`` composes the driver with its planner
and ``receiver_client.ApplySession``; ``steps`` holds the step objects.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ...errors import PeerUnreachable
from ...host.freeze import MountsHeld, no_mounts
from ...layout import PoolLayout
from ...transport import LinkHints, Peer
from ...transport.bandwidth import Bandwidth
from ..common.unit_state import UnitState
from .generation import Prepared
from .group_rounds import Cut, abandon
from .reports import SyncReport

log = logging.getLogger(__name__)
RETRIABLE = (PeerUnreachable,)


class Refused(Exception):
    """The peer refused a one-flight transaction (it was not as the sender expected); its
    status comes with it, and the attempt plans from there as after a status exchange."""

    def __init__(self, status: dict, error: dict | None = None):
        super().__init__(f"peer refused the transaction: {(error or {}).get('message', '')}")
        self.status, self.error = status, error


@dataclass
class Job:
    """What one sync_unit call asks for; the same for every attempt."""
    layout: PoolLayout
    unit_id: str
    members: list[str]
    peer: Peer
    mounts: MountsHeld = no_mounts   # holds the members' mounted filesystems during the capture
    epoch: int = 0
    demote: bool = False
    mode: str = "delta"
    compress: str = "auto"
    bandwidth: Bandwidth | None = None   # the one limiter every channel of the session sends through
    origin: dict | None = None
    cut: Cut | None = None        # one node's part of a group spanning nodes (replication.cut)
    roll_behind: bool = False     # the base rolls forward after the return (base_store.roll_behind)
    sources: dict | None = None   # volume id -> file captured instead of the live image (a CSI snapshot)
    link: LinkHints | None = None  # striping hints (None: the peer's own, ``Peer.link``)


class Session(Protocol):
    """One conversation with the peer's receiver about one unit (``receiver_client.ApplySession``):
    status and block-map requests, then one transaction (begin, records, commit) and
    a two-phase round's decision. Opened per attempt; the driver closes it.

    Protocol 4 (``version``) adds the one-flight transaction (``begin(one_flight=True)``,
    ``watch``/``answer``/``abort``) and stripe channels (``open_stripes``)."""

    peer: Peer
    round_trips: int
    channels_opened: int

    @property
    def version(self) -> int: ...

    @property
    def bytes_sent(self) -> int: ...

    def request_status(self) -> None: ...

    def read_status(self) -> dict: ...

    def fetch_maps(self, volumes, block_size: int, dest: Path) -> dict: ...

    def begin(self, tx: dict, *, one_flight: bool = False) -> dict | None: ...

    def watch(self) -> threading.Event: ...

    def answer(self, expect: str | None = None) -> dict: ...

    def abort(self) -> None: ...

    def open_stripes(self, token: str, count: int) -> list: ...

    def restart(self) -> dict: ...

    def send(self, data) -> None: ...

    def commit(self, records: int, manifest: str, *, expect: str = "committed") -> dict: ...

    def decide(self, txid: str, commit: bool) -> dict: ...

    def close(self) -> None: ...


class SessionOpener(Protocol):
    """Opens a session to the job's peer (connecting, or taking a warm receiver)."""

    def __call__(self, job: Job) -> Session: ...


@dataclass
class Attempt:
    """What the steps of one attempt hand to each other."""
    job: Job
    st: UnitState
    report: SyncReport
    session: Session | None = None            # open for the whole attempt
    peer_st: dict = field(default_factory=dict)
    pending: Prepared | None = None           # snap/<G+1> left by an earlier run
    early: Prepared | None = None             # captured while connecting (against G)
    prepared: Prepared | None = None          # what Ship sends
    one_flight: bool = False                  # no status asked: begin, records and trailer at once
    t0: float = field(default_factory=time.monotonic)   # start of the sync

    def report_so_far(self) -> dict:
        """The report as it stands now, this attempt's session counts included (the driver
        adds them to ``report`` only when the attempt ends, after the adopt saved a copy)."""
        d = self.report.to_dict()
        if self.session is not None:
            d["round_trips"] += self.session.round_trips
            d["channels_opened"] += self.session.channels_opened
        return d

    def drop_early(self) -> None:
        """Let go of the generation captured while connecting, which no step took; for a part
        of a spanning group, the round it cut is aborted with it (``group_rounds.abandon``)."""
        if self.early is not None:
            early, self.early = self.early, None
            early.stop()             # a plan still being written stops first
            shutil.rmtree(early.dir, ignore_errors=True)
            abandon(self.job.cut, early.meta.get("round"))


class Step(Protocol):
    name: str
    reported: bool      # listed in SyncReport.steps (Ship, which follows a step that ships, is not)

    def run(self, a: Attempt) -> None: ...


class Planner(Protocol):
    def load(self, job: Job) -> tuple[UnitState, Prepared | None]:
        """This end now: the unit's state (checked) and the generation an earlier run
        left pending, if any; anything else it left is swept."""

    def ahead(self, a: Attempt) -> None:
        """Work worth doing while the session opens (capture the next generation into
        ``a.early`` when nothing is pending, and start its plan: most syncs need it)."""

    def plan(self, a: Attempt) -> list[Step]:
        """The steps, from the state at both ends (``a.st``, ``a.pending``, ``a.peer_st``),
        or a typed conflict."""

    def flight(self, a: Attempt) -> list[Step] | None:
        """The steps of a one-flight sync (nothing pending here, the peer's status not
        asked), or None when this attempt must ask for the status first."""


def drive(job: Job, planner: Planner, open_session: SessionOpener, report: SyncReport, *,
          attempts: int = 1) -> None:
    """Run attempts until one completes; re-raise the last error when none does."""
    t0 = time.monotonic()
    for n in range(1, max(1, attempts) + 1):
        st, pending = planner.load(job)
        a = Attempt(job, st, report, pending=pending, t0=t0)
        try:
            _run(a, planner, open_session)
        except RETRIABLE as e:
            report.attempts.append({"steps": list(report.steps), "error": str(e)})
            if n >= attempts:
                raise
            log.warning("sync of %s, attempt %d failed (%s); planning again", job.unit_id, n, e)
            report.steps, report.resumed = [], False
            continue
        report.attempts.append({"steps": list(report.steps), "error": None})
        return


def _run(a: Attempt, planner: Planner, open_session: SessionOpener) -> None:
    t = time.monotonic()
    try:
        connect(a, planner, open_session)
        a.report.phases["connect_s"] = round(time.monotonic() - t, 4)
        if a.one_flight and _fly(a, planner):
            return
        steps = planner.plan(a)
        a.report.steps = [s.name for s in steps if s.reported]
        for step in steps:
            step.run(a)
    finally:
        a.drop_early()
        if a.session is not None:
            a.report.round_trips += a.session.round_trips
            a.report.channels_opened += a.session.channels_opened
            a.session.close()


def _fly(a: Attempt, planner: Planner) -> bool:
    """A one-flight sync; False when the peer refused it (``a.peer_st`` is then its status,
    and whatever the flight left pending is planned for as usual)."""
    steps = planner.flight(a)
    if steps is None:           # the planner wants the status after all
        a.session.request_status()
        a.peer_st, a.one_flight = a.session.read_status(), False
        return False
    a.report.steps = [s.name for s in steps if s.reported]
    try:
        for step in steps:
            step.run(a)
        return True
    except Refused as r:
        log.info("sync of %s: the peer refused the one-flight transaction; planning from its status",
                 a.job.unit_id)
        a.peer_st, a.one_flight = r.status, False
        return False


def connect(a: Attempt, planner: Planner, open_session: SessionOpener) -> None:
    """Open the session and ask for the peer's status in a thread; meanwhile the planner
    works ahead. Sets ``a.session`` (whenever it opened) and ``a.peer_st``. The report's
    ``connect_s`` is the longer of the two: ``open_s`` (the session, warm or not) and
    ``ahead_s`` (the capture and plan of the next generation, a cold read of its blocks). A fresh
    generation over protocol 4 asks nothing (``a.one_flight``): the transaction's begin
    carries what the sender expects, and a refusal brings the status."""
    opened: dict = {}
    may_fly = a.pending is None and a.job.mode == "delta" and a.job.cut is None

    t0 = time.monotonic()

    def _open():
        try:
            sess = open_session(a.job)
            a.report.phases["open_s"] = round(time.monotonic() - t0, 4)
            opened["session"] = sess
            if may_fly and sess.version >= 4:
                opened["fly"] = True
            else:
                sess.request_status()
        except BaseException as e:  # re-raised in the caller's thread
            opened["error"] = e

    opener = threading.Thread(target=_open, name=f"connect-{a.job.unit_id}", daemon=True)
    opener.start()
    try:
        planner.ahead(a)
        a.report.phases["ahead_s"] = round(time.monotonic() - t0, 4)
    finally:
        opener.join()
        a.session = opened.get("session")
    if "error" in opened:
        raise opened["error"]
    if opened.get("fly"):
        a.one_flight = True
        return
    a.peer_st = a.session.read_status()
