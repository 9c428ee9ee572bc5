"""The sync driver: plan -> steps -> report, and a new plan after a temporary failure.

Each attempt connects, reads the peer's status, asks ``plan.reconcile`` for the
steps and runs them in order. A failure of the connection (``PeerUnreachable``)
ends the attempt; the next attempt plans again from what is on disk and at the
peer (a generation left pending is finalized or resumed, never sent twice).
Other errors are final. Every attempt is recorded in ``report.attempts``.
"""
from __future__ import annotations

import logging
import threading
import time

from ..errors import PeerUnreachable
from . import plan as planner
from .remote import ApplySession
from .steps import Attempt, Job, plan_steps

log = logging.getLogger(__name__)
RETRIABLE = (PeerUnreachable,)


def drive(job: Job, load_state, report, *, attempts: int = 1) -> None:
    """Run attempts until one completes; re-raise the last error when none does."""
    from .sender import load_pending, sweep
    t0 = time.monotonic()
    for n in range(1, max(1, attempts) + 1):
        a = Attempt(job, load_state(), report, t0=t0)
        a.pending = load_pending(job.layout, job.unit_id, a.st.generation)
        sweep(job.layout, job.unit_id, a.st.generation, a.pending)
        t = time.monotonic()
        try:
            try:
                connect(a)
                report.phases["connect_s"] = round(time.monotonic() - t, 4)
                pend = a.pending and planner.Pending(
                    a.pending.meta["generation"], a.pending.meta["txid"],
                    tuple(m["volume_id"] for m in a.pending.meta["members"]))
                steps = plan_steps(planner.reconcile(job.unit_id, a.st.generation, pend, a.peer_st,
                                                     job.members, job.mode))
                report.steps = [s.name for s in steps if s.name != "ship"]
                for step in steps:
                    step.run(a)
            finally:
                a.drop_early()
                if a.session is not None:
                    a.session.close()
        except RETRIABLE as e:
            report.attempts.append({"steps": list(report.steps), "error": str(e)})
            if n >= attempts:
                raise
            log.warning("sync of %s, attempt %d failed (%s); planning again", job.unit_id, n, e)
            report.steps, report.resumed = [], False
            continue
        report.attempts.append({"steps": list(report.steps), "error": None})
        return


def connect(a: Attempt) -> None:
    """Open the apply session and read the peer's status in a thread; meanwhile, when
    nothing is pending, capture and plan the next generation (most syncs need it)."""
    opened: dict = {}
    job = a.job

    def _open():
        try:
            sess = ApplySession(job.peer, job.unit_id, bwlimit=job.bwlimit)
            opened["session"] = sess
            sess.request_status()
        except BaseException as e:  # re-raised in the caller's thread
            opened["error"] = e

    opener = threading.Thread(target=_open, name=f"connect-{job.unit_id}", daemon=True)
    opener.start()
    try:
        if a.pending is None and job.mode == "delta":
            a.early = a.prepare_delta()
    finally:
        opener.join()
        a.session = opened.get("session")
    if "error" in opened:
        raise opened["error"]
    a.peer_st = a.session.read_status()
    jr = a.peer_st.get("journal") or {}
    if jr.get("prepared"):
        # a round of a group spanning nodes was left prepared there: its decision, taken once
        # at this site (none recorded: abort), is what the planner settles it with
        jr["decision"] = job.cut.decision(jr.get("round")) if job.cut is not None and jr.get("round") else False
