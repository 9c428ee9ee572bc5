"""Send one prepared generation as a transaction over a session: begin, records, trailer.

The transaction header is plain data (``transaction``); the records come from the
plan file through ``records.stream_records`` into whatever ``send`` the session
offers, so a session that spreads one transaction over several channels can take
the place of ``receiver_client.ApplySession`` without a change here.
"""
from __future__ import annotations

import logging
import os
import time

from ...errors import PeerUnreachable, PoolFull, ReplicationConflict, StreamCorrupt
from ...transport import LinkHints
from ..wire import frames, stripe_token
from .driver import Refused, Session
from .generation import Prepared
from .progress import Progress
from .records import manifest_of, stream_records
from .reports import SyncReport
from .striping import stripe_count

RTT_WAIT = 2.0     # seconds a large transaction waits for the connection's first RTT measurement
ERROR_WAIT = 5.0   # seconds a stream cut on a stripe waits for the receiver's own word on the master

log = logging.getLogger(__name__)


def transaction(meta: dict, *, kind: str, epoch: int, demote: bool, origin: dict | None,
                two_phase: bool) -> dict:
    """The ``begin`` message's body for a prepared generation."""
    return {"txid": meta["txid"], "kind": kind, "base": meta["base_generation"],
            "target": meta["generation"], "epoch": epoch, "block_size": meta["block_size"],
            "mode": meta["mode"], "force": meta["mode"] == "compare", "demote": demote,
            "peer": (origin or {}).get("site") or os.uname().nodename, "origin": origin,
            "captured_at": meta.get("captured_at"), "repair": meta.get("repair"),
            "two_phase": two_phase, "round": meta.get("round") if two_phase else None,
            "members": [{k: m[k] for k in ("volume_id", "size", "base_size", "fresh")}
                        for m in meta["members"]]}


def stream(session: Session, prepared: Prepared, report: SyncReport, *, unit_id: str, epoch: int,
           demote: bool, kind: str, compress: str, origin: dict | None = None, progress_path=None,
           two_phase: bool = False, one_flight: bool = False, link: LinkHints | None = None,
           bwlimit: float | None = None, before_trailer=None) -> None:
    """Send the prepared generation and its trailer. two_phase: the peer only prepares it
    (votes) and waits for the round's decision (``Session.decide``). one_flight (protocol 4,
    a fresh generation): no ``ready`` is waited for; a peer not as expected answers
    ``refused`` and :class:`Refused` carries its status to the driver. A large generation
    over a long path is striped (``striping.stripe_count``).

    A generation still planning (``prepared.planning``, one flight only; its intent is
    recorded) is sent as its entries come; *before_trailer* runs once every record is out and
    before the trailer lets the peer commit (the caller waits for the plan there)."""
    meta = prepared.meta
    t0 = time.monotonic()
    v4 = session.version >= 4
    feed = prepared.planning.feed if prepared.planning is not None else None
    tx = transaction(meta, kind=kind, epoch=epoch, demote=demote, origin=origin, two_phase=two_phase)
    planned = int(meta["changed"] if feed is None else meta["estimate"])
    tx["planned_bytes"] = planned       # a receiver that runs out of space says how much was needed
    tx["ack"] = getattr(session.peer, "ack", "durable")
    # an early plan's records apply in plan order (``capture_feed``): one channel keeps that order
    ordered = meta.get("ordered") or (feed is not None and meta.get("early"))
    n = _stripe_count(session, planned, link or session.peer.link, bwlimit) if v4 and not ordered else 1
    token = stripe_token.new_token() if n > 1 else None
    if token:
        tx["stripes"] = {"token": token, "count": n - 1}
    one_flight = one_flight and v4
    skip, held = _begin(session, tx, prepared, unit_id, one_flight)
    stripes = session.open_stripes(token, n - 1) if token else []
    # protocol 4: the answer is read on a thread, so a receiver that stops on an error of its own
    # (a full pool) is heard even when a stripe's channel breaks first (a resumed transaction too)
    came = session.watch() if v4 else None
    try:
        sent, chain = _send_or_say_why(session, stripes, came, lambda: _send_records(
            session, prepared, stripes, skip, held, v4, came, compress, progress_path, unit_id, feed, planned))
        expect = "prepared" if two_phase else "committed"
        t_sent = time.monotonic()
        if came is not None and came.is_set():      # answered before the trailer: refused, or an error
            reply = session.answer(expect)
            session.abort()
        else:
            if before_trailer is not None:
                before_trailer()
            reply = session.commit(chain.count, chain.hexdigest(), expect=expect)
    except BaseException:
        for s in stripes:
            s.close()
        raise
    for s in stripes:
        s.finish()
    if reply["type"] == "refused":
        raise Refused(reply.get("status") or {}, reply.get("error"))
    if reply.get("txid") != meta["txid"] or reply.get("target" if two_phase else "generation") != meta["generation"]:
        raise ReplicationConflict(unit_id=unit_id, reason=f"peer committed {reply}, expected {meta['txid']}")
    _report_times(report, reply, t0, t_sent, time.monotonic())
    report.stripes, report.pipelined = n, feed is not None
    report.early = feed is not None and bool(meta.get("early"))
    _report_generation(report, meta, sent, two_phase)
    report.bytes_on_wire = session.bytes_sent   # the whole conversation, control included


def _report_times(report: SyncReport, reply: dict, t0: float, t_sent: float, t_end: float) -> None:
    report.phases["stream_s"] = round(t_end - t0, 4)
    # of which: the records out (the last one handed to the channels), and the wait for the answer
    report.phases["send_s"], report.phases["answer_s"] = round(t_sent - t0, 4), round(t_end - t_sent, 4)
    peer_s = 0.0
    for k in ("sync_s", "apply_s", "undo_wait_s"):          # the peer's commit, inside stream_s
        if isinstance(reply.get(k), (int, float)):
            report.phases[f"peer_{k}"] = reply[k]
            peer_s += reply[k]
    # of apply_s: the replica's block maps, the recovery point's undo copy; and that copy's
    # share made as the records arrived (off the path, but for undo_wait_s)
    for k in ("maps_s", "undo_s", "undo_ahead_s"):
        if isinstance(reply.get(k), (int, float)):
            report.phases[f"peer_{k}"] = reply[k]
    # the answer's wait less the peer's commit: the trip back and the data still in flight
    report.phases["answer_wire_s"] = round(max(0.0, t_end - t_sent - peer_s), 4)


def _send_or_say_why(session: Session, stripes, came, send):
    """Run *send*. When a channel breaks and the receiver stopped because it refused
    something (a pool out of space, a bad record), its typed error is on the master channel,
    which a one flight's watcher reads: raise that rather than the lost connection. A full
    pool is also what a stripe whose channel closed said as it stopped: that is raised when
    the master's own word is lost with its channel, or does not come in time."""
    try:
        return send()
    except PeerUnreachable as cut:
        said = [w for w in (s.last_word() for s in stripes) if isinstance(w, PoolFull)]
        for s in stripes:
            s.close()
        if came is not None and came.wait(ERROR_WAIT):
            try:
                session.answer()       # raises the peer's error; a plain answer here is not expected
            except PeerUnreachable:
                if not said:
                    raise
        if said:
            raise said[0] from None
        raise cut


def _stripe_count(session: Session, planned: int, link: LinkHints, bwlimit: float | None) -> int:
    if not link.stripes and planned <= link.window:
        return 1        # never waits for an RTT measurement when one channel will do
    return stripe_count(planned, rtt=session.peer.rtt(wait=RTT_WAIT), link=link, bwlimit=bwlimit)


def _begin(session: Session, tx: dict, prepared: Prepared, unit_id: str, one_flight: bool) -> tuple[int, set]:
    """Open the transaction; returns what the peer holds already (a resumed journal): the
    count of a version 3 prefix, or the set of plan indices (version 4)."""
    ready = session.begin(tx, one_flight=one_flight)
    if ready is None:
        return 0, set()
    meta, plan_path = prepared.meta, prepared.dir / "plan.bin"
    count = int(ready.get("resume_records") or 0)
    if not count:
        return 0, set()
    if meta.get("ordered"):
        # what the peer holds may be an early plan's first records as they were read then, and
        # records resumed after later ones would apply out of plan order: sent again, in order
        log.info("peer journal of %s holds part of a plan whose records apply in order; restarting it", unit_id)
        session.restart()
        return 0, set()
    if session.version < 4:
        if count <= meta["records"] and manifest_of(plan_path, count).hexdigest() == ready.get("manifest"):
            return count, set()
    else:
        try:
            held = frames.from_ranges(ready.get("held"), meta["records"])
        except StreamCorrupt:
            held = None
        if held is not None and len(held) == count and manifest_of(plan_path, only=held).hexdigest() == ready.get("manifest"):
            return 0, held
    log.warning("peer journal of %s does not match our plan; restarting it", unit_id)
    session.restart()
    return 0, set()


def _send_records(session: Session, prepared: Prepared, stripes, skip: int, held: set, indexed: bool, stop,
                  compress: str, progress_path, unit_id: str, feed, planned: int):
    meta = prepared.meta
    fds = [os.open(prepared.member_file(m), os.O_RDONLY) for m in meta["members"]]
    prog = Progress(progress_path, planned=planned, generation=meta["generation"]) if progress_path else None
    writes = [session.send] + [s.send for s in stripes]
    if prog:
        writes = [prog.wrap(w) for w in writes]
    try:
        sent, chain = stream_records(prepared.dir / "plan.bin", fds, writes, skip=skip, held=held,
                                     indexed=indexed, stop=stop, compress=compress, entries=feed,
                                     moved=prepared.moved if feed is not None else None)
        for s in stripes:
            s.end()
        return sent, chain
    except ReplicationConflict as e:
        raise ReplicationConflict(unit_id=unit_id, reason=e.fields.get("reason", str(e))) from None
    finally:
        for fd in fds:
            os.close(fd)
        if prog:
            prog.done()


def _report_generation(report: SyncReport, meta: dict, sent: int, two_phase: bool) -> None:
    report.txid = meta["txid"]
    report.base_generation = meta["base_generation"]
    report.target_generation = meta["generation"]
    report.members = [m["volume_id"] for m in meta["members"]]
    report.bytes_scanned = meta["scanned"]
    report.bytes_changed = meta["changed"]
    report.bytes_zeroed = meta["zeroed"]
    report.records = meta["records"]
    report.records_sent = sent
    report.reflink = bool(meta.get("fiemap"))
    report.ranges_cloned = int(meta.get("ranges_cloned", 0))
    for phase in ("capture_s", "plan_s", "freeze_s", "precopy_s") + (("cut_wait_s",) if two_phase else ()):
        report.phases[phase] = round(meta.get(phase, 0), 4)
