"""Send one prepared generation as a transaction over a session: begin, records, trailer.

The transaction header is plain data (``transaction``); the records come from the
plan file through ``delta.stream_records`` into whatever ``send`` the session
offers, so a session that spreads one transaction over several channels can take
the place of ``remote.ApplySession`` without a change here.
"""
from __future__ import annotations

import logging
import os
import time

from ..errors import ReplicationConflict
from .delta import AdaptiveCodec, manifest_of, stream_records
from .driver import Session
from .generation import Prepared
from .progress import Progress
from .report import SyncReport

log = logging.getLogger(__name__)


def transaction(meta: dict, *, kind: str, epoch: int, demote: bool, origin: dict | None,
                two_phase: bool) -> dict:
    """The ``begin`` message's body for a prepared generation."""
    return {"txid": meta["txid"], "kind": kind, "base": meta["base_generation"],
            "target": meta["generation"], "epoch": epoch, "block_size": meta["block_size"],
            "mode": meta["mode"], "force": meta["mode"] == "compare", "demote": demote,
            "peer": (origin or {}).get("site") or os.uname().nodename, "origin": origin,
            "captured_at": meta.get("captured_at"),
            "two_phase": two_phase, "round": meta.get("round") if two_phase else None,
            "members": [{k: m[k] for k in ("volume_id", "size", "base_size", "fresh")}
                        for m in meta["members"]]}


def stream(session: Session, prepared: Prepared, report: SyncReport, *, unit_id: str, epoch: int,
           demote: bool, kind: str, compress: str, origin: dict | None = None, progress_path=None,
           two_phase: bool = False) -> None:
    """Send the prepared generation and its trailer. two_phase: the peer only prepares it
    (votes) and waits for the round's decision (``Session.decide``)."""
    meta = prepared.meta
    plan_path = prepared.dir / "plan.bin"
    t0 = time.monotonic()
    ready = session.begin(transaction(meta, kind=kind, epoch=epoch, demote=demote, origin=origin,
                                      two_phase=two_phase))
    skip = int(ready.get("resume_records") or 0)
    if skip and (skip > meta["records"] or manifest_of(plan_path, skip).hexdigest() != ready.get("manifest")):
        log.warning("peer journal of %s does not match our plan; restarting it", unit_id)
        session.restart()
        skip = 0
    fds = [os.open(prepared.member_file(m), os.O_RDONLY) for m in meta["members"]]
    prog = Progress(progress_path, planned=meta["changed"], generation=meta["generation"]) if progress_path else None
    try:
        try:
            sent, chain = stream_records(plan_path, fds, prog.wrap(session.send) if prog else session.send,
                                         skip=skip, codec=AdaptiveCodec(compress))
        except ReplicationConflict as e:
            raise ReplicationConflict(unit_id=unit_id, reason=e.fields.get("reason", str(e))) from None
    finally:
        for fd in fds:
            os.close(fd)
        if prog:
            prog.done()
    reply = session.commit(chain.count, chain.hexdigest(), expect="prepared" if two_phase else "committed")
    if reply.get("txid") != meta["txid"] or reply.get("target" if two_phase else "generation") != meta["generation"]:
        raise ReplicationConflict(unit_id=unit_id, reason=f"peer committed {reply}, expected {meta['txid']}")
    report.phases["stream_s"] = round(time.monotonic() - t0, 4)
    for k in ("sync_s", "apply_s"):          # the peer's commit, inside stream_s
        if isinstance(reply.get(k), (int, float)):
            report.phases[f"peer_{k}"] = reply[k]
    _report_generation(report, meta, sent, two_phase)
    report.bytes_on_wire = session.bytes_sent   # the whole conversation, control included


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
