"""One delta transaction at the receiver, from ``begin`` to its trailer.

``begin`` is parsed (``parse_tx``) and checked against the replica
(``validate_begin``: role, epoch, base generation, image sizes). The journal of
the same transaction resumes after the records it holds, or a new one starts;
the sender hears ``ready`` with that count and the manifest chain. Records then
go into the journal until a control message: ``restart`` starts the journal
over; the ``commit`` trailer, once its manifest matches, commits and applies
(``committed``), or for a two-phase transaction prepares it (``prepared``, the
vote; ``replica.settle`` carries out the round's decision).

All records land in the one ``Journal`` through :meth:`Transaction.receive`: the apply
channel's own, and (version 4, striped) each stripe channel's, on a thread per stripe
(``Stripes``, over ``stripe_join``). Records then carry their plan index; the trailer requires
exactly 0..count-1 and checks the chain rebuilt in plan order.

A one-flight ``begin`` (version 4: the sender did not ask for the status first) gets no
``ready``: the records and trailer follow at once, and the answer is ``committed``, or, when
the replica is not as the sender expected (a refusal of ``validate_begin``), ``refused`` with
the status, sent as soon as ``begin`` is read; the frames that follow are read and dropped
up to the trailer or an ``abort``, and the conversation goes on.
"""
from __future__ import annotations

import errno
import os
import sys
import threading
import time

from ...errors import (
    BaseMismatch,
    DrPoolFull,
    ImageInUse,
    PeerUnreachable,
    ProtocolError,
    ReplicaIsPrimary,
    RepairAsked,
    ReplicationConflict,
    RoundUndecided,
    StaleEpoch,
    StreamCorrupt,
)
from ...failpoints import failpoint
from ...layout import PoolLayout, check_id
from ..common.unit_state import find_state
from ..wire import frames, stripe_token
from ..wire.frames import CODEC_ZSTD, FRAME, T_CONTROL, T_IRECORD, T_RECORD, FrameReader, ManifestChain
from . import commit_points, stripe_join
from . import origin_block as unit_origin
from .image_guard import ensure_members_not_in_use
from .journal import Journal
from .replica import record_generation, status_of
from .undo_copy import UndoAhead

RESUME_KEY = ("unit", "txid", "base", "target")    # a journal resumes only for the same transaction
# what a one-flight begin is refused with (answered ``refused``, the conversation goes on)
REFUSALS = (ReplicaIsPrimary, StaleEpoch, BaseMismatch, ReplicationConflict, RoundUndecided, ImageInUse,
            RepairAsked)
MAX_STRIPES = 64
STRIPE_WAIT = 60.0     # seconds the trailer waits for stripes that make no progress


class Replies:
    """Where the receiver's answers go (``program.Out``): control messages and whole frames.
    An interface for the annotations, met by shape; not a ``typing.Protocol``, whose import
    every receiver run would pay."""

    def control(self, msg: dict) -> None: ...

    def write(self, data) -> None: ...


def _stripes(msg: dict, version: int) -> dict | None:
    sp = msg.get("stripes")
    if not sp or version < 4:
        return None
    count = int(sp["count"])
    if not 1 <= count <= MAX_STRIPES:
        raise ProtocolError(reason=f"a transaction takes 1..{MAX_STRIPES} stripes")
    stripe_token.check_token(sp["token"])
    return {"token": sp["token"], "count": count}


def parse_tx(msg: dict) -> dict:
    try:
        version = frames.check_version(msg.get("version"))
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
              "captured_at": float(msg["captured_at"]) if msg.get("captured_at") is not None else None,
              "version": version, "stripes": _stripes(msg, version),
              "one_flight": bool(msg.get("one_flight")) and version >= 4,
              "planned_bytes": max(0, int(msg.get("planned_bytes") or 0)),
              "repair": check_id(msg["repair"], "repair id") if msg.get("repair") else None,
              # "durable": answer at the commit marker and apply after the answer
              "ack": "durable" if msg.get("ack") == "durable" else "applied"}
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(reason=f"bad begin message: {e!r}") from None
    if not members or len(members) > 0xFFFF or len({m["volume_id"] for m in members}) != len(members):
        raise ProtocolError(reason="bad member list")
    return tx


_AHEAD_THREAD = "drsvc-import-ahead"


def _import_commit_modules() -> None:
    try:
        import numpy  # noqa: F401
        import zstandard  # noqa: F401
    except ImportError:        # the commit raises it, if it ever needs the module
        pass


def start_import_ahead() -> None:
    """Import what a commit imports lazily on a thread, while the records come: numpy (the
    recovery points' range sets, ``common.ranges``) and zstandard (compressed records).
    Left to the commit, a fresh receiver's first transaction would pay for them between
    its commit marker and its answer. Once per process (repeat-safe)."""
    if "numpy" in sys.modules or any(t.name == _AHEAD_THREAD for t in threading.enumerate()):
        return
    # typing before the thread starts: a dataclass made on this thread reads
    # sys.modules["typing"], which the importing thread could be halfway through initialising
    import typing  # noqa: F401
    threading.Thread(target=_import_commit_modules, name=_AHEAD_THREAD, daemon=True).start()


def import_ahead(tx: dict) -> None:
    """:func:`start_import_ahead`, unless the transaction ships no data and grows nothing
    (an idle interval's generation; ``planned_bytes`` is an upper bound): its commit needs
    neither module, and its receiver never loads them."""
    if tx["version"] >= 4 and not tx["planned_bytes"] and all(m["size"] <= m["base_size"] for m in tx["members"]):
        return
    start_import_ahead()


def validate_begin(layout: PoolLayout, tx: dict, st) -> None:
    """Refuse a begin the replica is not ready for; *st* is the unit's state here."""
    unit_id = tx["unit"]
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
    elif st is not None and st.repair and tx["one_flight"] and tx.get("repair") != st.repair.get("id"):
        # a flight sent without reading the status: it is refused with the status, which
        # names the runs, and the sender plans them in (a sender that read the status and
        # sent no repair is an older one: its delta is taken, the repair stays asked for)
        raise RepairAsked(unit_id=unit_id)
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


class Stripes:
    """The stripe channels of one transaction, read by the master (a thread per stripe)."""

    def __init__(self, tx: Transaction, spec: dict):
        self.t, self.count = tx, spec["count"]
        self._cv = threading.Condition()
        self.done: set[int] = set()
        self.error: BaseException | None = None
        self.progress = time.monotonic()
        self.listener = stripe_join.Listener(spec["token"], self.count, self._attached)

    def _attached(self, stripe: stripe_join.Attached) -> None:
        threading.Thread(target=self._read, args=(stripe,), name=f"drsvc-stripe-{stripe.index}",
                         daemon=True).start()

    def _read(self, stripe: stripe_join.Attached) -> None:
        def cut(got, want):     # a cut channel: retriable at the sender, which resumes
            raise PeerUnreachable(peer=f"stripe {stripe.index}", reason="its channel closed mid-transaction")
        reader = FrameReader(stripe.stream.recv, on_eof=cut)
        try:
            self.t.begun.wait()
            while True:
                msg = self.t.receive(reader, on_frame=self._tick)
                if msg["type"] == "end":
                    break
                raise StreamCorrupt(reason=f"expected a stripe's end, got {msg['type']!r}")
            n = int(msg.get("records") or 0)
        except BaseException as e:  # noqa: BLE001 - the trailer raises it
            # the sender may read a stripe's answer before the master's (or instead of it, when
            # the master's channel is lost): both name a full pool, whichever channel met it
            full = out_of_space(e) or self.t.pool_is_full
            stripe.finish({"error": frames.error_message(self.t.pool_full_error() if full else e)})
            with self._cv:
                self.error = self.error or e
                self._cv.notify_all()
            return
        stripe.finish({"records": n})
        with self._cv:
            self.done.add(stripe.index)
            self._cv.notify_all()

    def _tick(self) -> None:
        self.progress = time.monotonic()

    def wait(self) -> None:
        """Until every stripe reached its end; a stripe's failure, or none moving for
        STRIPE_WAIT seconds, fails the transaction."""
        with self._cv:
            while len(self.done) < self.count and self.error is None:
                if time.monotonic() - self.progress > STRIPE_WAIT:
                    raise StreamCorrupt(reason=f"{self.count - len(self.done)} stripe(s) never ended")
                self._cv.wait(1.0)
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        self.listener.close()


class Transaction:
    """One transaction into the unit's journal (the caller holds the unit lock)."""

    def __init__(self, layout: PoolLayout, tx: dict, journal: Journal):
        self.layout, self.tx, self.journal = layout, tx, journal
        self.began = time.time()
        self.nbytes = 0          # frame bytes received, for the receive record
        self.refused = False     # one flight, refused: frames are read and dropped
        self.committed = False   # applied and answered `committed` (one phase)
        self.stripes: Stripes | None = None
        self.undo: UndoAhead | None = None   # the recovery point's undo copy, made as records arrive
        self.begun = threading.Event()   # begin decided (journal ready, or refused): stripes may read
        self.pool_is_full = False        # the transaction ended for a full pool
        # the unit's state here before this transaction, read at its begin (None: its first
        # copy, which answers once applied whatever the ack: it overwrites nothing, so no undo
        # copy is on its path, and the unit exists here as soon as the sender's enable returns)
        self.prior = None
        self._lock = threading.Lock()

    def run(self, reader: FrameReader, out: Replies) -> Journal:
        """Begin, receive, and end at the trailer. Returns the unit's journal afterwards."""
        if self.tx["stripes"]:
            self.stripes = Stripes(self, self.tx["stripes"])   # listening before anything is checked
        try:
            self.begin(out)
            self.begun.set()
            while True:
                msg = self.receive(reader)
                if msg["type"] == "restart" and not self.refused:
                    self.journal.create(self.tx)
                    self.journal.read_ahead()
                    self._ready(out)
                    continue
                if self.refused and msg["type"] in ("commit", "abort"):
                    if self.stripes is not None:
                        self.stripes.wait()
                    return self.journal
                if msg["type"] != "commit":
                    raise StreamCorrupt(reason=f"expected commit, got {msg['type']!r}")
                return self.finish(msg, out)
        except BaseException as e:
            # a stripe's write may be the one that met the full pool, while this thread only
            # saw its own channel close (the sender stopped on that stripe's word)
            stripe_error = self.stripes.error if self.stripes is not None else None
            full = (out_of_space(e) or out_of_space(stripe_error)) and not self.journal.committed()
            self.pool_is_full = full        # set before the seal: the stripes stopped by it say so
            # stripe threads may still be reading their channels: none may append from here
            # on (the journal is about to be synced and closed under them)
            self.journal.seal()
            if full:
                raise self._pool_full() from None
            self._keep_received()
            raise
        finally:
            if self.stripes is not None:
                self.stripes.close()
            if self.undo is not None:
                self.undo.close()

    def begin(self, out: Replies) -> None:
        tx, j = self.tx, self.journal
        try:
            self.prior = find_state(self.layout.root, tx["unit"])
            validate_begin(self.layout, tx, self.prior)
            if j.tx and j.prepared():
                raise RoundUndecided(unit_id=tx["unit"], target=j.tx["target"], round=j.tx.get("round"))
        except REFUSALS as e:
            if not tx["one_flight"]:
                raise
            self.refused = True
            out.control({"type": "refused", "txid": tx["txid"], "error": frames.error_message(e),
                         "status": status_of(self.layout, tx["unit"], j)})
            return
        import_ahead(tx)
        if (not tx.get("restart") and j.tx and not j.committed()
                and all(j.tx.get(k) == tx[k] for k in RESUME_KEY)):
            j.scan()
        else:
            j.create(tx)
        j.read_ahead()
        self.undo = UndoAhead.wanted(self.layout, tx)
        if not tx["one_flight"]:
            self._ready(out)

    def _ready(self, out: Replies) -> None:
        j = self.journal
        if self.tx["version"] < 4:   # records in plan order: resume after the held prefix
            out.control({"type": "ready", "resume_records": j.chain.count, "manifest": j.chain.hexdigest()})
            return
        held = sorted(j.durable())
        chain = ManifestChain()
        for i in held:
            chain.update(*j.index.entries[i])
        out.control({"type": "ready", "resume_records": len(held), "held": frames.to_ranges(held),
                     "manifest": chain.hexdigest()})

    def receive(self, reader: FrameReader, on_frame=None) -> dict:
        """Journal records until the next control message, and return that message. Safe on
        several readers at once (the stripes): the journal serialises its appends."""
        n_members = len(self.tx["members"])
        append, parse_record, decode = self.journal.append, frames.parse_record, frames.decode_payload
        next_frame, frame_size, keep = reader.next_frame, FRAME.size, not self.refused
        rtype = T_IRECORD if self.tx["version"] >= 4 else T_RECORD
        indexed = rtype == T_IRECORD
        dctx, nbytes = None, 0
        undo = self.undo.want if self.undo is not None else None
        try:
            while True:
                ftype, body = next_frame()
                nbytes += frame_size + len(body)
                if ftype != rtype:
                    break
                if on_frame is not None:
                    on_frame()
                if not keep:
                    continue
                hdr, payload = parse_record(body, indexed)
                if hdr.member >= n_members:
                    raise StreamCorrupt(reason=f"record for unknown member {hdr.member}")
                if hdr.codec == CODEC_ZSTD and dctx is None:
                    import zstandard  # lazily: the receiver pays for it only when zstd data arrives
                    dctx = zstandard.ZstdDecompressor()
                append(hdr, decode(hdr, payload, dctx))
                if undo is not None:
                    undo(hdr.member, hdr.offset, hdr.length)
        finally:
            with self._lock:
                self.nbytes += nbytes
        if ftype != T_CONTROL:
            raise StreamCorrupt(reason=f"unexpected frame type {ftype} in a transaction")
        return frames.parse_control(body)

    def finish(self, msg: dict, out: Replies) -> Journal:
        """The trailer: every record arrived (the manifest matches). Commit, or vote."""
        tx, j = self.tx, self.journal
        if self.stripes is not None:
            self.stripes.wait()
        count = msg.get("records")
        if not isinstance(count, int) or not j.index.complete(count) or msg.get("manifest") != j.chain.hexdigest():
            raise StreamCorrupt(reason=f"manifest mismatch: {len(j.index.entries)} records received, "
                                       f"{count} sent")
        ensure_members_not_in_use(self.layout, tx["unit"], [m["volume_id"] for m in tx["members"]])
        if tx["two_phase"]:
            # the vote: durable and complete, applied only on the round's decision
            j.mark_prepared(j.chain.count, j.chain.hexdigest())
            failpoint("receiver.after_prepare")
            out.control({"type": "prepared", "txid": tx["txid"], "target": tx["target"], "round": tx["round"]})
            return j
        if tx["ack"] == "durable" and not tx["demote"] and self.prior is not None:
            return self._answer_then_apply(out)
        return self._apply_then_answer(out)

    def _apply_then_answer(self, out: Replies) -> Journal:
        """Applied and recorded before the answer: the peer's ``ack`` "applied", a unit's
        first copy here, and always a Demote's final transaction (its answer lets the unit's
        lock go, ``ApplyConversation``, and the Promote that comes right after it must find
        the replica at the target)."""
        tx, j = self.tx, self.journal
        t_undo = time.monotonic()
        early = self.undo.finish() if self.undo is not None else {}
        failpoint("receiver.before_commit")
        t_sync = time.monotonic()
        j.mark_committed(j.chain.count, j.chain.hexdigest())
        failpoint("receiver.after_commit_marker")
        t_apply = time.monotonic()
        applied = j.apply(early=early)
        failpoint("receiver.after_apply")
        t_done = time.monotonic()
        undo_s = commit_points.undo_seconds(tx["txid"])      # before the record forgets it
        st = record_generation(self.layout, tx, began=self.began, nbytes=self.nbytes)
        failpoint("receiver.after_state")
        self.committed = True
        j.follow_maps()
        j.discard()
        out.control({"type": "committed", "generation": st.generation, "txid": tx["txid"],
                     "epoch": st.epoch, "cloned_bytes": applied.cloned, "copied_bytes": applied.copied,
                     # the peer's share of the stream phase: making it durable, then applying
                     "sync_s": round(t_apply - t_sync, 4), "apply_s": round(t_done - t_apply, 4),
                     "undo_s": round(undo_s, 4),
                     # the undo copy made as the records arrived: its time, and the wait for its last batch
                     "undo_ahead_s": round(self.undo.busy_s if self.undo is not None else 0.0, 4),
                     "undo_wait_s": round(t_sync - t_undo, 4)})
        return Journal(self.layout, tx["unit"])

    def _answer_then_apply(self, out: Replies) -> Journal:
        """The peer's ``ack`` "durable". The commit marker makes the generation durable here:
        from it on, this process or the replay at the next contact (``replica.recover``)
        brings the replica to the target, and nothing takes it back. So the answer goes out
        right after the marker, and the recovery point's undo copy (a cold read of the
        replica's old blocks), the apply, the point and the receive record follow it, before
        the next request is read. The unit's lock is held throughout, so whatever here reads
        the replica under it (a status, a promote, a drill, a verify) waits for them; the
        sender's worker does not. A failure after the answer keeps the committed journal for
        that replay and ends this process with the error, which the next request on the
        channel reads."""
        tx, j = self.tx, self.journal
        failpoint("receiver.before_commit")
        t_sync = time.monotonic()
        j.mark_committed(j.chain.count, j.chain.hexdigest())
        failpoint("receiver.after_commit_marker")
        t_answer = time.monotonic()
        self.committed = True
        out.control({"type": "committed", "generation": tx["target"], "txid": tx["txid"],
                     "epoch": max(self.prior.epoch, tx["epoch"]),
                     "sync_s": round(t_answer - t_sync, 4), "applies": "after-answer"})
        early = self.undo.finish() if self.undo is not None else {}
        t_apply = time.monotonic()
        j.apply(early=early)
        failpoint("receiver.after_apply")
        t_done = time.monotonic()
        # the work the answer did not wait for, in the receive record (``drsvc status``, benches)
        after = {"undo_wait_s": round(t_apply - t_answer, 4), "apply_s": round(t_done - t_apply, 4),
                 "undo_s": round(commit_points.undo_seconds(tx["txid"]), 4),
                 "undo_ahead_s": round(self.undo.busy_s if self.undo is not None else 0.0, 4),
                 "behind_s": round(t_done - t_answer, 4)}
        record_generation(self.layout, tx, began=self.began, nbytes=self.nbytes, after_answer=after)
        failpoint("receiver.after_state")
        # the block maps (an optimisation: a crash here leaves them unused) and the journal's
        # removal (a crash here leaves a journal that ``recover`` finds applied and recorded)
        j.follow_maps()
        j.discard()
        return Journal(self.layout, tx["unit"])

    def _pool_full(self) -> DrPoolFull:
        """A full pool: what arrived is removed rather than kept for a resume (it would hold the
        space every other unit's sync needs, and the same sync would meet the same wall). The
        undo copy's files go with the journal; recovery points are left alone."""
        written = _allocated(self.journal.dir)
        if self.undo is not None:
            self.undo.close()
            self.undo = None
        self.journal.discard()
        return self.pool_full_error(written)

    def pool_full_error(self, written: int | None = None) -> DrPoolFull:
        """The full pool as the sender is told it: what the sync needs and what had arrived."""
        tx = self.tx
        written = _allocated(self.journal.dir) if written is None else written
        st = find_state(self.layout.root, tx["unit"])
        free = _free_bytes(self.layout.root)
        needed = max(tx["planned_bytes"], written)
        return DrPoolFull(needed=needed, written=written, free=free, pool=str(self.layout.root),
                          generation=st.generation if st else 0, needed_text=_size(needed),
                          written_text=_size(written), free_text=_size(free))

    def _keep_received(self) -> None:
        """Keep what arrived durable, so the next attempt resumes after it."""
        j = self.journal
        try:
            if j.tx and not j.committed():
                j.sync()
        except Exception:
            pass


def out_of_space(exc: BaseException | None) -> bool:
    """Whether *exc*, or what it was raised from, is a full filesystem (or quota)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _allocated(d) -> int:
    """Bytes the transaction's files hold on disk (records, data, staging images)."""
    total = 0
    try:
        files = list(d.rglob("*")) if d.exists() else []
    except OSError:         # removed while walked: a stripe asks as the master discards it
        files = []
    for f in files:
        try:
            st = f.lstat()
        except OSError:
            continue
        if not os.path.isdir(f):
            total += st.st_blocks * 512
    return total


def _free_bytes(path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
