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
    stripe TOKEN INDEX              carry one stripe of a striped transaction: this channel's
                                    stream is handed to the transaction's receiver
                                    (``stripe_join``) until the stripe's end
    hashes UNIT BLOCK_SIZE VOL...   block hash maps of replica images
    snaphashes UNIT GENERATION [RATE]  block hash maps of the acked snapshot (control.consistency,
                                       control.scrub: RATE caps its reads, bytes per second)
    release UNIT [keep-image|delete-image]
    soon UNIT                       the peer's copy waits on this primary's next sync of the
                                    unit (a resync, a repair): the scheduler moves it to now

Anything else is refused (``UnknownVerb``): ``VERBS`` is the one table of verb,
handler and argument bounds. This module is the program (``main``), the
dispatch and its I/O; the verb bodies are ``receiver.verbs`` (a stripe's is
``receiver.stripe_join``'s), a transaction
``receiver.transaction``, the replica's state ``receiver.replica``.
Imports stay lean: this starts once per channel.
"""
from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Callable
from importlib import import_module

from ...errors import DrPoolNoSpace, DrsvcError, ProtocolError, StreamCorrupt, UnknownVerb
from ...layout import PoolLayout
from ..wire import frames
from ..wire.frames import T_CONTROL, FrameReader

_IO_BUF = 1 << 20


class Input:
    """The channel's input, read ahead in blocks of _IO_BUF (``recv(n)``: up to n bytes). The
    bytes read ahead can be taken (``take_ahead``): a ``stripe`` request hands them, with the
    descriptor, to the transaction's receiver."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = memoryview(b"")

    def recv(self, n: int) -> bytes:
        if not self.buf:
            if n >= _IO_BUF:
                return os.read(self.fd, n)
            self.buf = memoryview(os.read(self.fd, _IO_BUF))
        part, self.buf = self.buf[:n], self.buf[n:]
        return part

    def take_ahead(self) -> bytes:
        ahead, self.buf = bytes(self.buf), memoryview(b"")
        return ahead


class Out:
    """Unbuffered frame writer on a file descriptor or socket."""

    def __init__(self, fd: int = 1, sock=None):       # sock: a connected socket.socket
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
        self.write(frames.encode_control(msg))


Handler = Callable[[PoolLayout, FrameReader, Out, list], None]


class Verb:
    """One allowed verb: its handler (``module:function`` of this package, imported at the
    first call: a stripe channel never loads the journal's and the points' code) and the
    bounds of its argument count."""

    __slots__ = ("target", "min_args", "max_args")

    def __init__(self, target: str, min_args: int, max_args: int):
        self.target, self.min_args, self.max_args = target, min_args, max_args

    @property
    def handler(self) -> Handler:
        module, name = self.target.split(":")
        return getattr(import_module(f"{__package__}.{module}"), name)


def hello(layout: PoolLayout, reader: FrameReader, out: Out, args: list[str]) -> None:
    # `version` is the oldest spoken: a version 3 sender accepts no other in a greeting, and
    # picks 3; a newer one reads `versions` and speaks the highest both list
    out.control({"type": "hello", "version": min(frames.SUPPORTED_VERSIONS),
                 "versions": list(frames.SUPPORTED_VERSIONS), "verbs": sorted(VERBS)})


def serve(layout: PoolLayout, reader: FrameReader, out: Out, args: list[str]) -> None:
    """Answer requests until the sender closes the channel. Any error ends the
    process (main reports it typed): the stream may be mid-request. The commit's lazy
    imports start at the first request that can lead to one, not for a stripe's channel: a
    warm receiver waits for its next sync with them loaded. (A one-shot ``apply`` loads
    them only for a transaction that ships data: ``transaction.import_ahead``.)"""
    hello(layout, reader, out, args)
    while True:
        frame = reader.next_frame(eof_ok=True)
        if frame is None:
            return
        if frame[0] != T_CONTROL:
            raise StreamCorrupt(reason="expected a request")
        msg = frames.parse_control(frame[1])
        if msg["type"] != "request":
            raise ProtocolError(reason=f"expected a request, got {msg['type']!r}")
        frames.check_version(msg.get("version"))
        words = msg.get("verb"), *(msg.get("args") or ())
        if not all(isinstance(w, str) for w in words):
            raise ProtocolError(reason="a request's verb and arguments are strings")
        verb, vargs = parse_command(words)
        if verb == "serve":
            raise UnknownVerb(verb="serve")
        # the verb's module before the thread that imports numpy starts (which imports typing
        # first): a dataclass made here reads sys.modules["typing"], which that thread could
        # be halfway through initialising
        handler = VERBS[verb].handler
        if verb == "apply":
            from .transaction import start_import_ahead
            start_import_ahead()
        handler(layout, reader, out, vargs)


# The allowlist: verb -> handler and argument count bounds. Anything else is UnknownVerb.
VERBS: dict[str, Verb] = {
    "hello": Verb("program:hello", 0, 0),
    "serve": Verb("program:serve", 0, 0),
    "status": Verb("verbs:status", 1, 1),
    "apply": Verb("verbs:apply", 0, 0),
    "stripe": Verb("stripe_join:stripe", 2, 2),
    "hashes": Verb("verbs:hashes", 2, 4096),
    "snaphashes": Verb("verbs:snapshot_hashes", 2, 3),
    "release": Verb("verbs:release", 1, 2),
    "soon": Verb("verbs:soon", 1, 1),
}


def parse_command(words) -> tuple[str, list[str]]:
    if not words:
        raise UnknownVerb(verb="")
    verb, args = words[0], list(words[1:])
    if verb not in VERBS:
        raise UnknownVerb(verb=verb[:64])
    v = VERBS[verb]
    if not v.min_args <= len(args) <= v.max_args:
        raise ProtocolError(reason=f"{verb} takes {v.min_args}..{v.max_args} arguments, got {len(args)}")
    return verb, args


def _widen_pipe(fd: int) -> None:
    """sshd hands the stream over a pipe of 64 KiB: a wider one lets it decrypt ahead while
    this process writes to disk, with fewer wake-ups on both sides. Not a pipe, or a
    limit below 1 MiB (fs.pipe-max-size): left as it is."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _IO_BUF)
    except OSError:
        pass


class Usage(Exception):
    """The program's own command line is wrong (not a peer's request)."""


def parse_argv(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """``--pool POOL [--connect SOCKET] [VERB ARG...]``: (pool, socket, command words)."""
    opts: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for word in it:
        name, eq, value = word.partition("=")
        if name in ("--pool", "--connect") and not rest:
            if not eq:
                value = next(it, None)
                if value is None:
                    raise Usage(f"{name} needs a value")
            opts[name] = value
        elif word.startswith("--") and not rest:
            raise Usage(f"unknown option {word[:64]!r}")
        else:
            rest.append(word)
    if not opts.get("--pool"):
        raise Usage("--pool POOL is required")
    return opts["--pool"], opts.get("--connect"), rest


def main(argv=None) -> int:
    try:
        pool, connect, command = parse_argv(sys.argv[1:] if argv is None else list(argv))
    except Usage as e:
        print(f"usage: drsvc-receiver --pool POOL [--connect SOCKET] [VERB ARG...]: {e}", file=sys.stderr)
        return 2
    if connect:
        import socket       # only here: a channel's receiver (every sync's) reads its pipe
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(connect)
        source = Input(sock.fileno())
        out = Out(sock=sock)
    else:
        _widen_pipe(0)
        source = Input(0)
        out = Out(1)
    words = command or os.environ.get("SSH_ORIGINAL_COMMAND", "").split()
    reader = FrameReader(source.recv)
    reader.source = source      # a `stripe` request hands its descriptor and read-ahead on
    try:
        verb, args = parse_command(words)
        VERBS[verb].handler(PoolLayout(pool), reader, out, args)
        return 0
    except DrsvcError as e:
        code = 2
        err = e
    except Exception as e:  # reported typed to the sender; the traceback stays here
        code = 3
        err = e
        import traceback
        _say(traceback.format_exc())
        from .transaction import out_of_space
        if out_of_space(e):
            code, err = 2, DrPoolNoSpace(pool=pool, reason=f"{words[0] if words else 'the request'}: no space left on its filesystem")
    try:
        out.control(frames.error_message(err))
    except OSError:
        pass
    _say(f"drsvc-receiver: {err}\n")
    return code


def _say(text: str) -> None:
    """To stderr, unbuffered. The sender may have closed the channel already (it gave up, or
    stopped on a stripe's error): the exit code still says how this ended, and no traceback
    of the closed pipe replaces it."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
