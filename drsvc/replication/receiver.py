"""The receiver: the only program the replication key may run on the peer.

Run as ``python -m drsvc.replication.receiver --pool POOL`` from an SSH forced
command; the verb comes from SSH_ORIGINAL_COMMAND (or argv for local use):

    serve                           a warm receiver: says hello, then answers request after
                                    request (each a `request` control message naming one
                                    of the verbs below, allowlisted and checked as here)
    hello                           protocol version and verbs
    status UNIT                     replica state (recovers an unfinished journal first)
    apply                           a conversation: status / hashes requests, then one
                                    delta transaction (begin, records, commit)
    hashes UNIT BLOCK_SIZE VOL...   block hash maps of replica images
    snaphashes UNIT GENERATION      block hash maps of the acked snapshot (drsvc.replication.content)
    release UNIT [keep-image|delete-image]

Anything else is refused. Imports stay lean: this starts once per channel.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import socket
import sys
import time

from .. import store
from ..errors import (BaseMismatch, DrsvcError, InvalidParameter, OperationInProgress,
                      ProtocolError, ReplicaIsPrimary, ReplicationConflict, RoundUndecided, StaleEpoch,
                      StreamCorrupt, UnitNotFound, UnknownVerb)
from . import origin as unit_origin
from . import pointcommit, protocol
from .faults import failpoint
from .guard import ensure_members_not_in_use
from .journal import Journal
from .layout import PoolLayout, check_id
from .protocol import T_CONTROL, T_RECORD, FrameReader
from .state import UnitState, find_state, save_state

VERBS = {"hello": (0, 0), "status": (1, 1), "apply": (0, 0), "hashes": (2, 4096), "release": (1, 2),
         "snaphashes": (2, 2), "serve": (0, 0)}
LOCK_WAIT = 30.0
_IO_BUF = 1 << 20


class Out:
    """Unbuffered frame writer on a file descriptor or socket."""

    def __init__(self, fd: int = 1, sock: socket.socket | None = None):
        self.fd, self.sock = fd, sock

    def write(self, data) -> None:
        if self.sock is not None:
            self.sock.sendall(data)
            return
        mv = memoryview(data)
        while mv:
            n = os.write(self.fd, mv)
            mv = mv[n:]

    def control(self, msg: dict) -> None:
        self.write(protocol.encode_control(msg))


class UnitLock:
    """The unit's flock, waited for: a receiver of a just-dropped connection may still be exiting."""

    def __init__(self, layout: PoolLayout, unit_id: str):
        self.layout, self.unit_id = layout, unit_id
        self._cm = None

    def __enter__(self):
        self.layout.ensure_unit_dir(self.unit_id)
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            cm = store.file_lock(self.layout.lock_path(self.unit_id), blocking=False, key=self.unit_id)
            try:
                cm.__enter__()
                self._cm = cm
                return self
            except OperationInProgress:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


# -- replica state --------------------------------------------------------------
def recover(layout: PoolLayout, unit_id: str) -> Journal:
    """Finish a committed journal (idempotent replay). An uncommitted one is kept for resume,
    a prepared one (two-phase) for its round's decision."""
    j = Journal(layout, unit_id)
    if j.load() and j.committed():
        st = find_state(layout.root, unit_id)
        if st is None or st.txid != j.tx["txid"]:
            ensure_members_not_in_use(layout, unit_id, [m["volume_id"] for m in j.tx["members"]])
            j.apply()
            record_generation(layout, j.tx)
        j.discard()
    return j


def record_generation(layout: PoolLayout, tx: dict, *, began: float | None = None,
                      nbytes: int = 0) -> UnitState:
    st = find_state(layout.root, tx["unit"]) or UnitState(unit_id=tx["unit"], role="secondary")
    st.kind = tx["kind"]
    st.members = [m["volume_id"] for m in tx["members"]]
    st.sizes = {m["volume_id"]: m["size"] for m in tx["members"]}
    st.generation = tx["target"]
    st.epoch = max(st.epoch, tx["epoch"])
    st.block_size = tx["block_size"]
    st.txid = tx["txid"]
    st.peer = tx.get("peer")
    if tx.get("demote"):
        st.peer_demoted_at = tx["target"]
    if tx["mode"] == "compare":
        st.diverged = st.resync_requested = False
    if tx.get("origin"):
        st.origin = tx["origin"]
        unit_origin.ensure_replicas(layout.root, tx["unit"], tx["kind"], tx["origin"])
    pointcommit.after_commit(layout, tx)      # the new recovery point; pruning
    now = time.time()   # the receive record (the brief's contract; read by replication/health.py)
    st.add_received({"generation": tx["target"], "txid": tx["txid"], "received_at": now,
                     "duration_s": round(now - began, 4) if began else 0.0, "bytes": int(nbytes),
                     "captured_at": tx.get("captured_at")})
    save_state(layout.root, st)
    return st


def status_of(layout: PoolLayout, unit_id: str, journal: Journal | None = None) -> dict:
    st = find_state(layout.root, unit_id)
    msg = {"type": "status", "unit": unit_id, "exists": st is not None, "role": "secondary",
           "generation": 0, "epoch": 0, "txid": None, "members": [], "sizes": {}, "kind": None,
           "block_size": None, "peer_demoted_at": None, "demoted": False, "journal": None}
    if st is not None:
        msg.update(role=st.role, generation=st.generation, epoch=st.epoch, txid=st.txid,
                   members=st.members, sizes=st.sizes, kind=st.kind, block_size=st.block_size,
                   peer_demoted_at=st.peer_demoted_at, demoted=st.demoted,
                   diverged=st.diverged, resync_requested=st.resync_requested)
    j = journal or Journal(layout, unit_id)
    if j.tx or j.load():
        msg["journal"] = {"txid": j.tx["txid"], "base": j.tx["base"], "target": j.tx["target"],
                          "committed": j.committed(), "prepared": j.prepared(), "round": j.tx.get("round")}
    return msg


# -- two-phase rounds (a volume group whose members sit on several storage nodes) --------
def settle(layout: PoolLayout, unit_id: str, txid: str, commit: bool) -> dict:
    """Carry out a round's decision on this unit's prepared journal; repeat-safe.

    commit: mark it committed and apply it, as a one-phase commit trailer does;
    abort: drop it. A txid already applied answers committed again; the caller
    holds the unit lock."""
    j = Journal(layout, unit_id)
    st = find_state(layout.root, unit_id)
    if j.load() and j.tx["txid"] == txid and j.prepared():
        if not commit:
            j.discard()
            return {"type": "aborted", "txid": txid}
        if st is not None and st.role == "primary":
            raise ReplicaIsPrimary(unit_id=unit_id)
        vote = store.read_doc(j.prepared_path)
        ensure_members_not_in_use(layout, unit_id, [m["volume_id"] for m in j.tx["members"]])
        j.mark_committed(vote["records"], vote["manifest"])
        failpoint("receiver.after_decide_marker")
        applied = j.apply()
        st = record_generation(layout, j.tx)
        j.discard()
        return {"type": "committed", "generation": st.generation, "txid": txid, "epoch": st.epoch,
                "cloned_bytes": applied.cloned, "copied_bytes": applied.copied}
    if st is not None and st.txid == txid:
        return {"type": "committed", "generation": st.generation, "txid": txid, "epoch": st.epoch,
                "cloned_bytes": 0, "copied_bytes": 0}
    if commit:
        raise ReplicationConflict(unit_id=unit_id, reason=f"transaction {txid} is neither prepared nor applied here")
    return {"type": "aborted", "txid": txid}


def round_state(layout: PoolLayout, unit_id: str) -> dict:
    """What a promote reads on every node of a spanning group: the applied generation and
    the prepared one, if any."""
    with UnitLock(layout, unit_id):
        j = recover(layout, unit_id)
        st = find_state(layout.root, unit_id)
        prepared = None
        if j.tx and j.prepared():
            prepared = {"txid": j.tx["txid"], "target": j.tx["target"], "round": j.tx.get("round")}
        return {"exists": st is not None, "generation": st.generation if st else 0,
                "txid": st.txid if st else None, "role": st.role if st else "secondary", "prepared": prepared}


def settle_round(layout: PoolLayout, unit_id: str, txid: str, commit: bool) -> dict:
    with UnitLock(layout, unit_id):
        return settle(layout, unit_id, txid, commit)


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
    for m in tx["members"]:
        if m["fresh"]:
            continue
        try:
            size = os.stat(layout.image(m["volume_id"])).st_size
        except FileNotFoundError:
            size = None
        if size != m["base_size"]:
            raise ReplicationConflict(
                unit_id=unit_id, reason=f"replica image of {m['volume_id']} has size {size}, "
                                        f"the delta's base has {m['base_size']}")
    ensure_members_not_in_use(layout, unit_id, [m["volume_id"] for m in tx["members"]])


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


# -- verbs ------------------------------------------------------------------------
def verb_hello(layout, reader, out, args):
    out.control({"type": "hello", "version": protocol.VERSION,
                 "versions": list(protocol.SUPPORTED_VERSIONS), "verbs": sorted(VERBS)})


def verb_status(layout, reader, out, args):
    unit_id = check_id(args[0])
    with UnitLock(layout, unit_id):
        out.control(status_of(layout, unit_id, recover(layout, unit_id)))


def send_hashes(layout: PoolLayout, out: Out, block_size: int, volumes) -> None:
    from .blockmap import check_block_size, hash_image
    check_block_size(block_size)
    for vol in volumes:
        path = layout.image(vol)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            out.control({"type": "map", "volume_id": vol, "exists": False, "size": 0,
                         "block_size": block_size})
            continue
        try:
            size = os.fstat(fd).st_size
            out.control({"type": "map", "volume_id": vol, "exists": True, "size": size,
                         "block_size": block_size})
            for first, digests in hash_image(fd, size, block_size):
                out.write(protocol.encode_hashes(first, digests))
        finally:
            os.close(fd)
        out.control({"type": "end", "volume_id": vol})
    out.control({"type": "done"})


def verb_hashes(layout, reader, out, args):
    unit_id = check_id(args[0])
    try:
        block_size = int(args[1])
    except ValueError:
        raise InvalidParameter(key="block_size", reason="not an integer") from None
    volumes = [check_id(v, "volume id") for v in args[2:]]
    with UnitLock(layout, unit_id):
        recover(layout, unit_id)
        if not volumes:
            st = find_state(layout.root, unit_id)
            if st is None:
                raise UnitNotFound(unit_id=unit_id)
            volumes = st.members
        send_hashes(layout, out, block_size, volumes)


def verb_release(layout, reader, out, args):
    unit_id = check_id(args[0])
    how = args[1] if len(args) > 1 else "keep-image"
    if how not in ("keep-image", "delete-image"):
        raise InvalidParameter(key="release", reason="keep-image or delete-image")
    with UnitLock(layout, unit_id):
        recover(layout, unit_id).discard()
        st = find_state(layout.root, unit_id)
        removed = []
        if st is not None and how == "delete-image":
            if st.role == "primary":
                raise ReplicaIsPrimary(unit_id=unit_id)
            for vol in st.members:
                if store.remove(layout.image(vol)):
                    removed.append(vol)
        if st is not None:
            store.remove(layout.state_path(unit_id))
    # the lock file goes last, outside the lock
    shutil.rmtree(layout.unit_dir(unit_id), ignore_errors=True)
    out.control({"type": "released", "unit": unit_id, "existed": st is not None,
                 "removed_images": removed})


def verb_apply(layout, reader, out, args):
    lock = None
    unit_id = None
    journal = None
    try:
        while True:
            frame = reader.next_frame(eof_ok=True)
            if frame is None:
                return
            ftype, body = frame
            if ftype != T_CONTROL:
                raise StreamCorrupt(reason="record outside a transaction")
            msg = protocol.parse_control(body)
            kind = msg["type"]
            if kind in ("status", "begin", "hashes"):
                uid = check_id(msg.get("unit"))
                if unit_id is None:
                    unit_id = uid
                    lock = UnitLock(layout, unit_id).__enter__()
                    journal = recover(layout, unit_id)
                elif uid != unit_id:
                    raise ProtocolError(reason="one unit per apply session")
            if kind == "status":
                out.control(status_of(layout, unit_id, journal))
            elif kind == "hashes":
                vols = [check_id(v, "volume id") for v in msg.get("volumes", [])]
                send_hashes(layout, out, int(msg["block_size"]), vols)
            elif kind == "begin":
                journal = receive_transaction(layout, reader, out, parse_tx(msg), journal)
            elif kind == "decide":
                if unit_id is None or msg.get("unit") != unit_id:
                    raise ProtocolError(reason="decide names the session's unit")
                if journal is not None:
                    journal.close()
                out.control(settle(layout, unit_id, check_id(msg.get("txid"), "transaction id"),
                                   msg.get("commit") is True))
                journal = Journal(layout, unit_id)
            elif kind == "bye":
                return
            else:
                raise ProtocolError(reason=f"unexpected control message {kind!r}")
    finally:
        if journal is not None:
            journal.close()
        if lock is not None:
            lock.__exit__(None, None, None)


def receive_transaction(layout: PoolLayout, reader: FrameReader, out: Out, tx: dict,
                        journal: Journal) -> Journal:
    began, nbytes = time.time(), 0
    validate_begin(layout, tx)
    j = journal
    if j.tx and j.prepared():
        raise RoundUndecided(unit_id=tx["unit"], target=j.tx["target"], round=j.tx.get("round"))
    key = ("unit", "txid", "base", "target")
    if (not tx.get("restart") and j.tx and not j.committed()
            and all(j.tx.get(k) == tx[k] for k in key)):
        resumed = j.scan()
    else:
        j.create(tx)
        resumed = 0
    out.control({"type": "ready", "resume_records": resumed, "manifest": j.chain.hexdigest()})
    n_members = len(tx["members"])
    dctx = None
    try:
        while True:
            ftype, body = reader.next_frame()
            nbytes += protocol.FRAME.size + len(body)
            if ftype == T_RECORD:
                hdr, payload = protocol.parse_record(body)
                if hdr.member >= n_members:
                    raise StreamCorrupt(reason=f"record for unknown member {hdr.member}")
                if hdr.codec == protocol.CODEC_ZSTD and dctx is None:
                    import zstandard
                    dctx = zstandard.ZstdDecompressor()
                j.append(hdr, protocol.decode_payload(hdr, payload, dctx))
                continue
            if ftype != T_CONTROL:
                raise StreamCorrupt(reason=f"unexpected frame type {ftype} in a transaction")
            msg = protocol.parse_control(body)
            if msg["type"] == "restart":
                j.create(tx)
                out.control({"type": "ready", "resume_records": 0, "manifest": j.chain.hexdigest()})
                continue
            if msg["type"] != "commit":
                raise StreamCorrupt(reason=f"expected commit, got {msg['type']!r}")
            if msg.get("records") != j.chain.count or msg.get("manifest") != j.chain.hexdigest():
                raise StreamCorrupt(reason=f"manifest mismatch: {j.chain.count} records received, "
                                           f"{msg.get('records')} sent")
            ensure_members_not_in_use(layout, tx["unit"], [m["volume_id"] for m in tx["members"]])
            if tx["two_phase"]:
                # the vote: durable and complete, applied only on the round's decision
                j.mark_prepared(j.chain.count, j.chain.hexdigest())
                failpoint("receiver.after_prepare")
                out.control({"type": "prepared", "txid": tx["txid"], "target": tx["target"],
                             "round": tx["round"]})
                return j
            failpoint("receiver.before_commit")
            t_sync = time.monotonic()
            j.mark_committed(j.chain.count, j.chain.hexdigest())
            failpoint("receiver.after_commit_marker")
            t_apply = time.monotonic()
            applied = j.apply()
            failpoint("receiver.after_apply")
            t_done = time.monotonic()
            st = record_generation(layout, tx, began=began, nbytes=nbytes)
            failpoint("receiver.after_state")
            j.discard()
            out.control({"type": "committed", "generation": st.generation, "txid": tx["txid"],
                         "epoch": st.epoch, "cloned_bytes": applied.cloned, "copied_bytes": applied.copied,
                         # the peer's share of the stream phase: making it durable, then applying
                         "sync_s": round(t_apply - t_sync, 4), "apply_s": round(t_done - t_apply, 4)})
            return Journal(layout, tx["unit"])
    except BaseException:
        # keep what arrived durable, so the next attempt resumes after it
        try:
            if j.tx and not j.committed():
                j.sync()
        except Exception:
            pass
        raise


def verb_serve(layout, reader, out, args):
    """Answer requests until the sender closes the channel. Any error ends the
    process (main reports it typed): the stream may be mid-request."""
    verb_hello(layout, reader, out, args)
    while True:
        frame = reader.next_frame(eof_ok=True)
        if frame is None:
            return
        if frame[0] != T_CONTROL:
            raise StreamCorrupt(reason="expected a request")
        msg = protocol.parse_control(frame[1])
        if msg["type"] != "request":
            raise ProtocolError(reason=f"expected a request, got {msg['type']!r}")
        protocol.check_version(msg.get("version"))
        words = msg.get("verb"), *(msg.get("args") or ())
        if not all(isinstance(w, str) for w in words):
            raise ProtocolError(reason="a request's verb and arguments are strings")
        verb, vargs = parse_command(words)
        if verb == "serve":
            raise UnknownVerb(verb="serve")
        HANDLERS[verb](layout, reader, out, vargs)


HANDLERS = {"hello": verb_hello, "status": verb_status, "apply": verb_apply,
            "hashes": verb_hashes, "release": verb_release,
            "snaphashes": lambda *a: _content().verb_snapshot_hashes(*a), "serve": verb_serve}


def _content():
    from . import content
    return content


def parse_command(words) -> tuple[str, list[str]]:
    if not words:
        raise UnknownVerb(verb="")
    verb, args = words[0], list(words[1:])
    if verb not in VERBS:
        raise UnknownVerb(verb=verb[:64])
    lo, hi = VERBS[verb]
    if not lo <= len(args) <= hi:
        raise ProtocolError(reason=f"{verb} takes {lo}..{hi} arguments, got {len(args)}")
    return verb, args


def _widen_pipe(fd: int) -> None:
    """sshd hands the stream over a pipe of 64 KiB: a wider one lets it decrypt ahead while
    this process writes to disk, with fewer wake-ups on both sides. Not a pipe, or a
    limit below 1 MiB (fs.pipe-max-size): left as it is."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _IO_BUF)
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="drsvc-receiver")
    ap.add_argument("--pool", required=True)
    ap.add_argument("--connect", help="serve over this unix socket instead of stdin/stdout")
    ap.add_argument("command", nargs="*")
    opts = ap.parse_args(argv)
    if opts.connect:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(opts.connect)
        rfile = sock.makefile("rb", buffering=_IO_BUF)
        out = Out(sock=sock)
    else:
        _widen_pipe(0)
        rfile = open(0, "rb", buffering=_IO_BUF, closefd=False)  # noqa: SIM115 - lives as long as the process
        out = Out(1)
    words = opts.command or os.environ.get("SSH_ORIGINAL_COMMAND", "").split()
    reader = FrameReader(rfile.read)
    try:
        verb, args = parse_command(words)
        HANDLERS[verb](PoolLayout(opts.pool), reader, out, args)
        return 0
    except DrsvcError as e:
        code = 2
        err = e
    except Exception as e:  # reported typed to the sender; the traceback stays here
        code = 3
        err = e
        import traceback
        traceback.print_exc(file=sys.stderr)
    try:
        out.control(protocol.error_message(err))
    except OSError:
        pass
    print(f"drsvc-receiver: {err}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
