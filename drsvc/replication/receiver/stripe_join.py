"""Stripe hand-off at the receiver: a stripe channel's stream joins its transaction's receiver.

A striped transaction (wire protocol 4) is one ``apply`` conversation (the master: it
holds the unit lock and the journal) plus stripe channels, each a receiver that was
asked ``stripe TOKEN INDEX``. The sender chose TOKEN (random, 128 bits) and named it in
``begin``; the master then listens on the abstract unix socket ``drsvc-stripe-TOKEN``
(no file, no path limit, gone with the process). A stripe process connects to it,
retrying briefly (it may come before the master read ``begin``), and passes its input
and output descriptors (``SCM_RIGHTS``), its index and the bytes it had read ahead of
the stripe's first frame. The master reads that stripe's frames itself, into the one
journal, up to the stripe's ``end`` frame, exactly (no byte past it), and then answers
the stripe process, which says ``stripe-done`` to the sender and serves its next request.

The master accepts a connection only from a process of its own uid (``SO_PEERCRED``)
that names the token; anything else is closed unread.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import time

from ...errors import ProtocolError, StreamCorrupt
from ..wire import frames
from ..wire.stripe_token import check_token

HELLO = struct.Struct(">16sII")   # token | index | bytes read ahead (they follow the message)
CONNECT_WAIT = 10.0               # seconds a stripe retries before the master listens
_MAX_AHEAD = 8 << 20


def _address(token: str) -> bytes:
    return b"\0drsvc-stripe-" + token.encode()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = sock.recv(n - len(out))
        if not b:
            raise StreamCorrupt(reason="the stripe hand-off ended early")
        out += b
    return bytes(out)


class Exact:
    """``recv(n)`` over a descriptor, after the bytes a stripe process had read ahead:
    never more than asked for, so nothing past the stripe's last frame is consumed."""

    def __init__(self, fd: int, ahead: bytes = b""):
        self.fd, self.ahead = fd, memoryview(ahead)

    def recv(self, n: int) -> bytes:
        if self.ahead:
            part, self.ahead = bytes(self.ahead[:n]), self.ahead[n:]
            return part
        return os.read(self.fd, n)


class Attached:
    """One stripe as the master holds it: its stream and the process waiting for the word."""

    def __init__(self, conn: socket.socket, index: int, fds: list[int], ahead: bytes):
        self.conn, self.index, self.fds = conn, index, fds
        self.stream = Exact(fds[0], ahead)

    def finish(self, reply: dict) -> None:
        """Give the descriptors back and tell the stripe process how it went."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        try:
            self.conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass          # the stripe process is gone; its channel ends with it
        self.conn.close()


class Listener:
    """The master's end: accepts the stripes of one transaction (token) on a thread and
    hands each to *on_stripe(Attached)*."""

    def __init__(self, token: str, count: int, on_stripe):
        self.token = check_token(token)
        self.count, self.on_stripe = count, on_stripe
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(_address(token))
        self.sock.listen(max(1, count))
        self.seen: set[int] = set()
        self._thread = threading.Thread(target=self._accept, name="drsvc-stripe-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while len(self.seen) < self.count:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return             # closed
            try:
                stripe = self._admit(conn)
            except (OSError, StreamCorrupt, ProtocolError):
                conn.close()
                continue
            self.seen.add(stripe.index)
            self.on_stripe(stripe)

    def _admit(self, conn: socket.socket) -> Attached:
        conn.settimeout(30)
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise ProtocolError(reason=f"stripe from uid {uid}")
        fds = array.array("i")
        msg, anc, _flags, _addr = conn.recvmsg(HELLO.size, socket.CMSG_SPACE(2 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        try:
            if len(msg) < HELLO.size:
                msg += _recv_exact(conn, HELLO.size - len(msg))
            token, index, nahead = HELLO.unpack(msg)
            if token != self.token or index >= self.count or index in self.seen or nahead > _MAX_AHEAD \
                    or len(fds) != 2:
                raise ProtocolError(reason="a stripe that does not belong to this transaction")
            ahead = _recv_exact(conn, nahead) if nahead else b""
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        conn.settimeout(None)
        return Attached(conn, index, list(fds), ahead)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def attach(token: str, index: int, fds: tuple[int, int], ahead: bytes, *, wait: float = CONNECT_WAIT) -> dict:
    """The stripe process's end: hand *fds* (input, output) and the bytes read ahead to the
    master of transaction *token*, then wait for its word (a dict: ``records``, or ``error``)."""
    raw = check_token(token)
    if len(ahead) > _MAX_AHEAD:
        raise ProtocolError(reason="a stripe read too far ahead of its request")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + wait
    while True:
        try:
            sock.connect(_address(token))
            break
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                sock.close()
                raise ProtocolError(reason=f"no transaction {token[:8]}… is waiting for stripes") from None
            time.sleep(0.005)
    with sock:
        sock.sendmsg([HELLO.pack(raw, index, len(ahead))],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        if ahead:
            sock.sendall(ahead)
        line = b""
        while not line.endswith(b"\n"):
            b = sock.recv(4096)
            if not b:
                raise StreamCorrupt(reason="the transaction's receiver went away mid-stripe")
            line += b
    try:
        return json.loads(line)
    except ValueError:
        raise StreamCorrupt(reason="a bad word from the transaction's receiver") from None


def stripe(layout, reader, out, args: list[str]) -> None:
    """``stripe TOKEN INDEX``: hand this channel's stream to the receiver of transaction TOKEN,
    wait until it read the stripe's end, and say so (``stripe-done``). The channel then
    serves the next request, as after any other."""
    try:
        index = int(args[1])
    except ValueError:
        raise ProtocolError(reason="a stripe index is a number") from None
    source = reader.source
    if source is None or index < 0:
        raise ProtocolError(reason="this receiver cannot hand its stream on")
    fd_out = getattr(out, "fd", 1) if getattr(out, "sock", None) is None else out.sock.fileno()
    word = attach(args[0], index, (source.fd, fd_out), source.take_ahead())
    if word.get("error"):
        frames.raise_error(word["error"])
    out.control({"type": "stripe-done", "index": index, "records": int(word.get("records", 0))})
