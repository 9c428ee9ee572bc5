"""The sender's side of the receiver verbs, over any drsvc.transport.Peer.

Requests go to a warm receiver when the peer's transport keeps a session (its
``session_key``): a process-wide set of idle `serve` channels per key, each a
receiver that answers request after request. A channel is put back only after a
conversation that ended cleanly (every reply read, no transaction open); any
error closes it. A request that fails on a reused channel (the connection or the
receiver went away while idle) is sent once more on a fresh one: status, hashes,
hello and release are idempotent, and a transaction resumes by its handshake. A warm
receiver found dead as the request itself (or a one flight's ``begin``, the first word of
its conversation) is sent goes the same way at once: nothing reached it.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from ...errors import DrsvcError, PeerUnreachable, StreamCorrupt
from ...transport import LimitedChannel
from ...transport.bandwidth import Bandwidth
from ..common.blockmap import BlockMap
from ..wire import frames
from ..wire.frames import T_CONTROL, T_HASHES, FrameReader
from .striping import stripe_count

MAX_IDLE = 16           # warm receivers kept per peer connection (a master and its stripes)
IDLE_TTL = 600.0        # seconds a warm receiver may wait unused

_LOCK = threading.Lock()
_IDLE: dict[tuple, list] = {}


def reader_for(peer, chan) -> FrameReader:
    def eof(got, want):
        raise PeerUnreachable(peer=peer.name, reason="the receiver closed the connection mid-reply")
    return FrameReader(chan.recv, on_eof=eof)


def _take(key):
    now = time.monotonic()
    stale = []
    chan = None
    with _LOCK:
        idle = _IDLE.get(key, [])
        while idle:
            c, since = idle.pop()
            if now - since < IDLE_TTL and c.alive():
                chan = c
                break
            stale.append(c)
    for c in stale:
        c.close()
    return chan


def _give(key, chan) -> None:
    with _LOCK:
        idle = _IDLE.setdefault(key, [])
        if len(idle) < MAX_IDLE:
            idle.append((chan, time.monotonic()))
            return
    chan.close()


def discard_idle(key=None) -> int:
    """Close warm receivers (of one peer session, or all); returns how many."""
    with _LOCK:
        keys = list(_IDLE) if key is None else [key]
        chans = [c for k in keys for c, _ in _IDLE.pop(k, [])]
    for c in chans:
        c.close()
    return len(chans)


class Lease:
    """One request to the receiver: on a warm `serve` channel when the peer keeps a
    session, else on a receiver process started for this verb alone."""

    def __init__(self, peer, verb: str, *args: str, fresh: bool = False):
        self.peer, self.key = peer, peer.session_key
        self.reused = False
        if self.key is None:
            self.chan = peer.open(verb, *args)
            self.version = frames.VERSION     # a receiver started for us, from this release
            self.start = self.chan.bytes_sent
            return
        request = {"type": "request", "verb": verb, "args": list(args)}
        try:
            self._ask(request, fresh)
        except PeerUnreachable:
            if not self.reused:
                raise
            discard_idle(self.key)      # a warm receiver that went away while idle: its siblings likely too
            self._ask(request, True)

    def _ask(self, request: dict, fresh: bool) -> None:
        """Send *request* on a warm receiver (or a fresh one)."""
        chan = None if fresh else _take(self.key)
        self.reused = chan is not None
        self.chan = chan if chan is not None else self._open_serve()
        self.version = getattr(self.chan, "drsvc_version", frames.VERSION)
        self.start = self.chan.bytes_sent
        try:
            self.chan.send(frames.encode_control(dict(request, version=self.version)))
        except BaseException:
            self.chan.close()
            raise

    def _open_serve(self):
        """A fresh `serve` receiver, greeted."""
        chan = self.peer.open("serve")
        try:
            hello = frames.check_greeting(_first_control(self.peer, chan))
        except BaseException:
            chan.close()
            raise
        # the conversation's version: the highest both speak (a v3 peer lists only 3)
        chan.drsvc_version = max(set(hello.get("versions") or [hello["version"]])
                                 & set(frames.SUPPORTED_VERSIONS))
        return chan

    @property
    def serving(self) -> bool:
        return self.key is not None

    def end_input(self) -> None:
        """The request needs nothing more from us (a one-shot receiver sees EOF)."""
        if not self.serving:
            self.chan.close_write()

    def release(self, clean: bool) -> None:
        if self.serving and clean and self.chan.alive():
            _give(self.key, self.chan)
        else:
            self.chan.close()


def _first_control(peer, chan) -> dict:
    frame = reader_for(peer, chan).next_frame()
    if frame[0] != T_CONTROL:
        raise StreamCorrupt(reason=f"expected a control frame, got type {frame[0]}")
    return frames.parse_control(frame[1])


def _exchange(peer, verb: str, args, talk):
    """Run an idempotent request; once more on a fresh channel if a reused one failed."""
    for attempt in (0, 1):
        lease = Lease(peer, verb, *args, fresh=attempt > 0)
        ok = False
        try:
            result = talk(lease)
            ok = True
            return result
        except PeerUnreachable:
            if attempt or not lease.reused:
                raise
            discard_idle(lease.key)    # its siblings likely died with it
        finally:
            lease.release(ok)
    raise AssertionError("unreachable")


def _call(peer, verb: str, *args: str, expect: str) -> dict:
    def talk(lease):
        lease.end_input()
        return reader_for(peer, lease.chan).control(expect)
    return _exchange(peer, verb, args, talk)


def hello(peer) -> dict:
    return _call(peer, "hello", expect="hello")


RTT_WAIT = 2.0     # seconds warm() waits for the connection's first RTT measurement


def warm(peer, *, bwlimit: float | None = None) -> dict:
    """Leave the peer as a sync finds it in a busy worker: every connection striping uses
    logged in, and a greeted receiver warm for the master and for each stripe a large
    transaction over this path takes (``striping.stripe_count`` of the measured RTT), so
    neither a worker's first sync nor a Demote's final sync opens a login or a channel.
    Returns the hello, with ``warm`` = {lane: receivers} added."""
    msg = hello(peer)
    n = stripe_count(1 << 62, rtt=peer.rtt(wait=RTT_WAIT), link=peer.link, bwlimit=bwlimit)
    lanes = max(1, peer.link.connections) if n > 1 else 1
    want = {0: 1}
    for i in range(n - 1):          # stripe i rides lane (i + 1) % lanes (open_stripes)
        want[(i + 1) % lanes] = want.get((i + 1) % lanes, 0) + 1
    errors = _greet_all([(peer.lane(lane), k) for lane, k in want.items()])
    if errors:
        raise errors[0]
    return dict(msg, warm=want)


def _greet_all(targets) -> list[BaseException]:
    """Hold k greeted receivers at once on each (peer lane, k), in parallel, then put them
    all back warm (held together, so each is a receiver of its own)."""
    leases: list[tuple[Lease, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(lane) -> None:
        try:
            lease = Lease(lane, "hello")
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            errors.append(e)
            return
        ok = False
        try:
            lease.end_input()
            reader_for(lane, lease.chan).control("hello")
            ok = True
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        with lock:
            leases.append((lease, ok))

    threads = [threading.Thread(target=one, args=(lane,), daemon=True)
               for lane, k in targets for _ in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lease, ok in leases:
        lease.release(ok)
    return errors


def peer_status(peer, unit_id: str) -> dict:
    """The replica's state on the peer (an unfinished committed journal is completed first)."""
    return _call(peer, "status", unit_id, expect="status")


def ask_soon(peer, unit_id: str) -> dict:
    """Ask the primary for its next sync of the unit now (``verbs.soon``): {"asked": bool}."""
    return _call(peer, "soon", unit_id, expect="soon")


def release_peer(peer, unit_id: str, *, delete_image: bool = False) -> dict:
    return _call(peer, "release", unit_id, "delete-image" if delete_image else "keep-image",
                 expect="released")


def read_maps(reader: FrameReader, dest: Path, block_size: int) -> dict:
    """Receive block maps into files under *dest*: volume_id -> (exists, size, path)."""
    out = {}
    while True:
        msg = reader.control()
        if msg["type"] == "done":
            return out
        if msg["type"] != "map":
            raise StreamCorrupt(reason=f"expected a map, got {msg['type']!r}")
        vol = msg["volume_id"]
        if not msg["exists"]:
            out[vol] = (False, 0, None)
            continue
        path = Path(dest) / f"{vol}.peer.map"
        with BlockMap.create(path, block_size, int(msg["size"])) as m:
            while True:
                ftype, body = reader.next_frame()
                if ftype == T_HASHES:
                    first, digests = frames.parse_hashes(body)
                    m.write(first, digests)
                    continue
                if ftype == T_CONTROL:
                    end = frames.parse_control(body)
                    if end["type"] == "error":
                        frames.raise_error(end)
                    if end["type"] == "end":
                        break
                raise StreamCorrupt(reason="bad frame in a block map")
        out[vol] = (True, int(msg["size"]), path)


def fetch_maps(peer, unit_id: str, volumes, block_size: int, dest: Path) -> dict:
    def talk(lease):
        lease.end_input()
        return read_maps(reader_for(peer, lease.chan), dest, block_size)
    return _exchange(peer, "hashes", [unit_id, str(block_size), *volumes], talk)


class ApplySession:
    """One `apply` conversation: status/hashes requests, then one transaction.

    Its channel goes back to the warm set only if every request got its reply and
    no transaction is open when it closes. The first status exchange is retried
    once on a fresh channel when a reused one turns out dead."""

    peer = None
    round_trips = 0          # replies waited for (a request's answer), for the report
    channels_opened = 0      # fresh receivers started (each a few round trips over SSH)

    def __init__(self, peer, unit_id: str, *, bandwidth: Bandwidth | None = None):
        self.peer, self.unit_id = peer, unit_id
        # the one limiter every byte of this session goes through, on every stripe
        self.limiter = bandwidth
        self.round_trips = self.channels_opened = 0
        self._replies: queue.Queue | None = None
        self._stripes: list[Stripe] = []
        self._attach(fresh=False)

    def _attach(self, *, fresh: bool) -> None:
        self.lease = Lease(self.peer, "apply", fresh=fresh)
        self.channels_opened += 0 if self.lease.reused or not self.lease.serving else 1
        self.raw = self.lease.chan
        self.chan = self.limited(self.raw)
        self.reader = reader_for(self.peer, self.chan)
        self._clean, self._in_tx, self._pending = True, False, 0
        self._talked = False      # anything beyond the first status exchange

    def limited(self, chan):
        """*chan* behind the session's limiter (every stripe shares the one object)."""
        return LimitedChannel(chan, self.limiter) if self.limiter is not None else chan

    @property
    def version(self) -> int:
        """The protocol version of this conversation (3 with a peer not yet upgraded)."""
        return self.lease.version

    @property
    def bytes_sent(self) -> int:
        return self.raw.bytes_sent - self.lease.start + sum(s.bytes_sent for s in self._stripes)

    def _retry_fresh(self) -> bool:
        """After a failure of the first exchange on a reused channel: start over on a fresh one."""
        if not self.lease.reused or self._talked:
            return False
        self.lease.release(False)
        discard_idle(self.lease.key)
        self._attach(fresh=True)
        return True

    def send_control(self, msg: dict) -> None:
        self.send(frames.encode_control(msg))

    def send(self, data) -> None:
        try:
            self.chan.send(data)
        except PeerUnreachable:
            self._clean = False
            if self._replies is None:      # a watcher owns the reader: its caller asks it instead
                self._surface_peer_error()
            raise
        except BaseException:
            self._clean = False
            raise

    def _read(self, expect: str | None) -> dict:
        self.round_trips += 1
        try:
            return self.reader.control(expect)
        except BaseException:
            self._clean = False
            raise

    def _surface_peer_error(self) -> None:
        """If the receiver stopped because it refused something, raise its typed error."""
        try:
            msg = self.reader.control()
        except DrsvcError as e:
            if getattr(e, "remote", False):
                raise
        except Exception:
            pass
        else:
            raise StreamCorrupt(reason=f"unexpected {msg['type']!r} from the receiver")

    def request_status(self) -> None:
        msg = frames.encode_control({"type": "status", "unit": self.unit_id})
        try:
            self.send(msg)
        except PeerUnreachable:
            if not self._retry_fresh():
                raise
            self.send(msg)
        self._pending += 1

    def read_status(self) -> dict:
        try:
            st = self._read("status")
        except PeerUnreachable:
            if not self._retry_fresh():
                raise
            self.request_status()
            st = self._read("status")
        self._pending -= 1
        return st

    def fetch_maps(self, volumes, block_size: int, dest: Path) -> dict:
        self._talked = True
        self.send_control({"type": "hashes", "unit": self.unit_id, "volumes": list(volumes),
                           "block_size": block_size})
        try:
            return read_maps(self.reader, dest, block_size)
        except BaseException:
            self._clean = False
            raise

    def begin(self, tx: dict, *, one_flight: bool = False) -> dict | None:
        """Open the transaction. Its ``ready`` is read (one round trip), unless *one_flight*
        (version 4): then nothing is waited for, and :meth:`watch` reads the one answer."""
        msg = dict(tx, type="begin", unit=self.unit_id, version=self.version,
                   **({"one_flight": True} if one_flight else {}))
        try:
            self.send_control(msg)
        except PeerUnreachable:
            # a one flight's begin is the first word on its channel: a reused one found dead
            # (its receiver or connection went away while idle) is replaced, as for a status
            was = self.version
            if not self._retry_fresh() or self.version != was:
                raise
            self.send_control(msg)
        self._talked = self._in_tx = True
        return None if one_flight else self._read("ready")

    def watch(self) -> threading.Event:
        """Read the transaction's one answer on a thread (it may come before the trailer is
        sent: a refusal); the event is set when it came."""
        self._replies, came = queue.Queue(), threading.Event()

        def run():
            try:
                msg = self.reader.control()
            except BaseException as e:  # noqa: BLE001 - handed to answer()
                msg = e
            self._replies.put(msg)
            came.set()
        threading.Thread(target=run, name=f"drsvc-replies-{self.unit_id}", daemon=True).start()
        self.round_trips += 1
        return came

    def answer(self, expect: str | None = None) -> dict:
        """The answer :meth:`watch` read (waiting for it): ``committed``, ``prepared`` or
        ``refused``; a peer's error is raised typed."""
        msg, self._replies = self._replies.get(), None
        if isinstance(msg, BaseException):
            self._clean = False
            raise msg
        if msg["type"] == "refused":
            self._in_tx = False
        elif expect and msg["type"] != expect:
            self._clean = False
            raise StreamCorrupt(reason=f"expected {expect!r}, got {msg['type']!r}")
        return msg

    def open_stripes(self, token: str, count: int) -> list[Stripe]:
        """The stripe channels of this session's transaction, behind the session's limiter."""
        stripes = open_stripes(self.peer, token, count, self.limited, self.peer.link.connections)
        self.channels_opened += sum(1 for s in stripes if s.fresh)
        self._stripes = stripes
        return stripes

    def abort(self) -> None:
        """End a refused one-flight transaction's frames (the receiver drops them)."""
        self.send_control({"type": "abort"})

    def restart(self) -> dict:
        self.send_control({"type": "restart"})
        return self._read("ready")

    def commit(self, records: int, manifest: str, *, expect: str = "committed") -> dict:
        """The trailer; a two-phase transaction's answer is ``prepared`` (its vote). When a
        watcher reads the answer (one flight), it is taken from there."""
        try:
            self.send_control({"type": "commit", "records": records, "manifest": manifest})
        except PeerUnreachable:
            if self._replies is None:
                raise
            # the receiver stopped before the trailer (it refused the begin, and every record
            # fitted in the pipe): what it said before it went is the answer, not the broken pipe
            return self.answer(expect)
        reply = self.answer(expect) if self._replies is not None else self._read(expect)
        self._in_tx = False
        return reply

    def decide(self, txid: str, commit: bool) -> dict:
        """Carry a round's decision to the peer's prepared journal: ``committed`` or ``aborted``."""
        self._talked = True
        self.send_control({"type": "decide", "unit": self.unit_id, "txid": txid, "commit": bool(commit)})
        reply = self._read("committed" if commit else "aborted")
        return reply

    def close(self) -> None:
        clean = self._clean and not self._in_tx and not self._pending
        try:
            self.chan.send(frames.encode_control({"type": "bye"}))
            if not self.lease.serving:
                self.chan.close_write()
        except DrsvcError:
            clean = False
        self.lease.release(clean)


class Stripe:
    """One stripe channel of a transaction, behind the session's limiter."""

    def __init__(self, peer, token: str, index: int, limited):
        self.index = index
        self.lease = Lease(peer, "stripe", token, str(index))
        self.chan = limited(self.lease.chan)
        self.reader = reader_for(peer, self.chan)
        self.ok = False

    @property
    def fresh(self) -> bool:
        return self.lease.serving and not self.lease.reused

    @property
    def bytes_sent(self) -> int:
        return self.lease.chan.bytes_sent - self.lease.start

    def send(self, data) -> None:
        self.chan.send(data)

    def end(self) -> None:
        """The stripe's last frame: the master stops reading this channel there."""
        self.chan.send(frames.encode_control({"type": "end"}))
        self.lease.end_input()

    def finish(self) -> None:
        """Read the stripe process's ``stripe-done`` (it came before the master's answer) and
        put the channel back warm; a stripe that failed is closed instead."""
        try:
            self.reader.control("stripe-done")
            self.ok = True
        except DrsvcError:
            self.ok = False
        self.lease.release(self.ok)

    def last_word(self) -> DrsvcError | None:
        """The typed error the stripe's receiver sent as it stopped, once its channel is closed
        and what it said has arrived; None otherwise. It never waits: a killed stripe's
        channel can stay open, and silent, while the master holds its descriptors."""
        chan = self.lease.chan
        if chan.alive() or not chan.buffered():
            return None
        try:
            self.reader.control()
        except DrsvcError as e:
            return e if getattr(e, "remote", False) else None
        except Exception:   # noqa: BLE001 - a channel with no word left
            return None
        return None

    def close(self) -> None:
        self.lease.release(False)


def open_stripes(peer, token: str, count: int, limited, connections: int) -> list[Stripe]:
    """Open *count* stripe channels (in parallel: a cold one costs a few round trips), dealt
    over *connections* of the peer; the master is on connection 0."""
    lanes = max(1, connections)
    out: list[Stripe | None] = [None] * count
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = Stripe(peer.lane((i + 1) % lanes), token, i, limited)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in out:
            if s is not None:
                s.close()
        raise errors[0]
    return out
