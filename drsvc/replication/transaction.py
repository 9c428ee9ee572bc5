"""One delta transaction at the receiver, from ``begin`` to its trailer.

``begin`` is parsed (``parse_tx``) and checked against the replica
(``validate_begin``: role, epoch, base generation, image sizes). The journal of
the same transaction resumes after the records it holds, or a new one starts;
the sender hears ``ready`` with that count and the manifest chain. Records then
go into the journal until a control message: ``restart`` starts the journal
over; the ``commit`` trailer, once its manifest matches, commits and applies
(``committed``), or for a two-phase transaction prepares it (``prepared``, the
vote; ``replica.settle`` carries out the round's decision).

All records land in the one ``Journal`` through :meth:`Transaction.receive`,
called today on the apply channel's reader.
"""
from __future__ import annotations

import os
import time
from typing import Protocol

from ..errors import (BaseMismatch, ProtocolError, ReplicaIsPrimary, ReplicationConflict, RoundUndecided,
                      StaleEpoch, StreamCorrupt)
from . import origin as unit_origin
from . import protocol
from .faults import failpoint
from .guard import ensure_members_not_in_use
from .journal import Journal
from .layout import PoolLayout, check_id
from .protocol import CODEC_ZSTD, FRAME, T_CONTROL, T_RECORD, FrameReader
from .replica import record_generation
from .state import find_state

RESUME_KEY = ("unit", "txid", "base", "target")    # a journal resumes only for the same transaction


class Replies(Protocol):
    """Where the receiver's answers go (``receiver.Out``): control messages and whole frames."""

    def control(self, msg: dict) -> None: ...

    def write(self, data) -> None: ...


def parse_tx(msg: dict) -> dict:
    try:
        protocol.check_version(msg.get("version"))
        members = [{"volume_id": check_id(m["volume_id"], "volume id"), "size": int(m["size"]),
                    "base_size": int(m["base_size"]), "fresh": bool(m["fresh"])}
                   for m in msg["members"]]
        tx = {"txid": check_id(msg["txid"], "transaction id"), "unit": check_id(msg["unit"]),
              "kind": msg["kind"] if msg["kind"] in ("volume", "group") else "volume",
              "base": int(msg["base"]), "target": int(msg["target"]), "epoch": int(msg["epoch"]),
              "block_size": int(msg["block_size"]), "mode": msg.get("mode", "delta"),
              "force": bool(msg.get("force")), "demote": bool(msg.get("demote")),
              "peer": str(msg.get("peer") or "") or None, "members": members,
              "origin": unit_origin.parse_origin(msg.get("origin")),
              "two_phase": bool(msg.get("two_phase")),
              "round": check_id(msg["round"], "round") if msg.get("round") else None,
              "captured_at": float(msg["captured_at"]) if msg.get("captured_at") is not None else None}
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(reason=f"bad begin message: {e!r}") from None
    if not members or len(members) > 0xFFFF or len({m["volume_id"] for m in members}) != len(members):
        raise ProtocolError(reason="bad member list")
    return tx


def validate_begin(layout: PoolLayout, tx: dict) -> None:
    unit_id = tx["unit"]
    st = find_state(layout.root, unit_id)
    role = st.role if st else "secondary"
    if role == "primary":
        raise ReplicaIsPrimary(unit_id=unit_id)
    have_epoch = st.epoch if st else 0
    if tx["epoch"] < have_epoch:
        raise StaleEpoch(unit_id=unit_id, epoch=tx["epoch"], have=have_epoch)
    have = st.generation if st else 0
    if tx["mode"] == "compare":
        if not (tx.get("force") or (st is not None and st.resync_requested)):
            raise ReplicationConflict(unit_id=unit_id, reason="a compare sync must be requested explicitly")
    elif st is not None and (st.diverged or st.resync_requested):
        raise ReplicationConflict(unit_id=unit_id, reason="the replica holds writes of its own since it was "
                                                          "demoted; it takes only a compare sync (ResyncVolume)")
    elif tx["base"] != have:
        raise BaseMismatch(unit_id=unit_id, have=have, base=tx["base"])
    if tx["target"] <= tx["base"] and tx["mode"] != "compare":
        raise ProtocolError(reason="target generation must follow the base")
    _check_base_sizes(layout, tx)
    ensure_members_not_in_use(layout, unit_id, [m["volume_id"] for m in tx["members"]])


def _check_base_sizes(layout: PoolLayout, tx: dict) -> None:
    for m in tx["members"]:
        if m["fresh"]:
            continue
        try:
            size = os.stat(layout.image(m["volume_id"])).st_size
        except FileNotFoundError:
            size = None
        if size != m["base_size"]:
            raise ReplicationConflict(
                unit_id=tx["unit"], reason=f"replica image of {m['volume_id']} has size {size}, "
                                           f"the delta's base has {m['base_size']}")


class Transaction:
    """One transaction into the unit's journal (the caller holds the unit lock)."""

    def __init__(self, layout: PoolLayout, tx: dict, journal: Journal):
        self.layout, self.tx, self.journal = layout, tx, journal
        self.began = time.time()
        self.nbytes = 0          # frame bytes received, for the receive record
        self._dctx = None        # a zstd decompressor, made on the first zstd record

    def run(self, reader: FrameReader, out: Replies) -> Journal:
        """Begin, receive, and end at the trailer. Returns the unit's journal afterwards."""
        self.begin(out)
        try:
            while True:
                msg = self.receive(reader)
                if msg["type"] == "restart":
                    self.journal.create(self.tx)
                    self._ready(out, 0)
                    continue
                if msg["type"] != "commit":
                    raise StreamCorrupt(reason=f"expected commit, got {msg['type']!r}")
                return self.finish(msg, out)
        except BaseException:
            self._keep_received()
            raise

    def begin(self, out: Replies) -> None:
        tx, j = self.tx, self.journal
        validate_begin(self.layout, tx)
        if j.tx and j.prepared():
            raise RoundUndecided(unit_id=tx["unit"], target=j.tx["target"], round=j.tx.get("round"))
        if (not tx.get("restart") and j.tx and not j.committed()
                and all(j.tx.get(k) == tx[k] for k in RESUME_KEY)):
            resumed = j.scan()
        else:
            j.create(tx)
            resumed = 0
        self._ready(out, resumed)

    def _ready(self, out: Replies, resumed: int) -> None:
        out.control({"type": "ready", "resume_records": resumed, "manifest": self.journal.chain.hexdigest()})

    def receive(self, reader: FrameReader) -> dict:
        """Journal records until the next control message, and return that message."""
        n_members = len(self.tx["members"])
        append, parse_record, decode = self.journal.append, protocol.parse_record, protocol.decode_payload
        next_frame, frame_size = reader.next_frame, FRAME.size
        dctx, nbytes = self._dctx, 0
        try:
            while True:
                ftype, body = next_frame()
                nbytes += frame_size + len(body)
                if ftype != T_RECORD:
                    break
                hdr, payload = parse_record(body)
                if hdr.member >= n_members:
                    raise StreamCorrupt(reason=f"record for unknown member {hdr.member}")
                if hdr.codec == CODEC_ZSTD and dctx is None:
                    import zstandard  # lazily: the receiver pays for it only when zstd data arrives
                    dctx = zstandard.ZstdDecompressor()
                append(hdr, decode(hdr, payload, dctx))
        finally:
            self._dctx, self.nbytes = dctx, self.nbytes + nbytes
        if ftype != T_CONTROL:
            raise StreamCorrupt(reason=f"unexpected frame type {ftype} in a transaction")
        return protocol.parse_control(body)

    def finish(self, msg: dict, out: Replies) -> Journal:
        """The trailer: every record arrived (the manifest matches). Commit, or vote."""
        tx, j = self.tx, self.journal
        if msg.get("records") != j.chain.count or msg.get("manifest") != j.chain.hexdigest():
            raise StreamCorrupt(reason=f"manifest mismatch: {j.chain.count} records received, "
                                       f"{msg.get('records')} sent")
        ensure_members_not_in_use(self.layout, tx["unit"], [m["volume_id"] for m in tx["members"]])
        if tx["two_phase"]:
            # the vote: durable and complete, applied only on the round's decision
            j.mark_prepared(j.chain.count, j.chain.hexdigest())
            failpoint("receiver.after_prepare")
            out.control({"type": "prepared", "txid": tx["txid"], "target": tx["target"], "round": tx["round"]})
            return j
        failpoint("receiver.before_commit")
        t_sync = time.monotonic()
        j.mark_committed(j.chain.count, j.chain.hexdigest())
        failpoint("receiver.after_commit_marker")
        t_apply = time.monotonic()
        applied = j.apply()
        failpoint("receiver.after_apply")
        t_done = time.monotonic()
        st = record_generation(self.layout, tx, began=self.began, nbytes=self.nbytes)
        failpoint("receiver.after_state")
        j.discard()
        out.control({"type": "committed", "generation": st.generation, "txid": tx["txid"],
                     "epoch": st.epoch, "cloned_bytes": applied.cloned, "copied_bytes": applied.copied,
                     # the peer's share of the stream phase: making it durable, then applying
                     "sync_s": round(t_apply - t_sync, 4), "apply_s": round(t_done - t_apply, 4)})
        return Journal(self.layout, tx["unit"])

    def _keep_received(self) -> None:
        """Keep what arrived durable, so the next attempt resumes after it."""
        j = self.journal
        try:
            if j.tx and not j.committed():
                j.sync()
        except Exception:
            pass
