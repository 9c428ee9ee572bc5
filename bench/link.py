"""A WAN link emulator: a userspace TCP relay that delays and paces.

    python -m bench.link --listen 127.0.0.1:0 --to 127.0.0.1:2222 --rtt 100ms --rate 1gbit
                         [--queue 16MiB] [--listen H:P --to H:P ...] [--back H:P=H:P ...]

This kernel has no netem ("Specified qdisc kind is unknown"), so the link is a
relay in its own process. Every connection accepted on a --listen address is
relayed to the matching --to address (pairs in order); a --back route is one
whose client sits at the far end (site b dialling site a), so its
client-to-server bytes take the link's other direction.

The model, per direction of the link (a -> b, b -> a), shared by every connection
through the emulator, as one real link is shared:

* serialisation: a chunk read at time t leaves no earlier than the link is free,
  holds the wire for len / rate, and arrives delay = RTT / 2 after its last byte
  left. Chunks of one connection arrive in order.
* a bounded bottleneck queue: the bytes waiting for the wire, (free_at - now) x
  rate, may not exceed --queue (default one bandwidth-delay product plus 1 MiB).
  Past it the emulator stops reading the sending socket until the queue drains:
  the kernel's socket buffers fill and the sender blocks, so a sender's window
  keeps mattering. Besides, a connection never holds more than queue + BDP bytes
  in the emulator (with rate 0 that bound is --queue alone, 64 MiB by default).
* connection set-up costs one RTT, as TCP's handshake does: the emulator dials the
  server RTT / 2 after it accepted the client (the SYN's trip), and the client's
  first bytes leave no earlier than one RTT after it connected (the SYN-ACK's).

Rate 0 (or absent) is unlimited. Specs are parsed by :func:`parse_link`
(``rtt=100ms,rate=1gbit[,queue=16MiB]``); the CLI's --rtt/--rate/--queue go
through the same parsers. The relay reads up to 256 KiB a call and does no work
per byte; bench.wan measures its ceiling (a raw TCP push through it) in the
same run as the syncs. On SIGTERM it prints the bytes it carried per direction.

The emulator prints ``ready PORT ...`` (its listening ports, in route order) once
it accepts connections.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import re
import signal
import socket
import sys
from dataclasses import dataclass

MiB = 1 << 20
SOCK_BUF = 1 << 20          # each leg's kernel buffers: bounded, so back-pressure reaches the sender
WRITE_HIGH = 4 << 20        # user-space write buffer past which the source is paused
UNLIMITED_QUEUE = 64 * MiB  # rate 0: bytes one connection may hold in the emulator


class LinkSpecError(ValueError):
    """A link spec (rtt, rate, queue) that cannot be read; the message says what is expected."""


_DURATION = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
         "b/s": 1, "kib/s": 1 << 10, "mib/s": 1 << 20, "gib/s": 1 << 30}
_SIZE = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_NUMBER = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z/]*)\s*")


def _quantity(kind: str, text: str, units: dict, expected: str, *, bare_zero: bool = True) -> float:
    m = _NUMBER.fullmatch(str(text).lower())
    if not m or (m.group(2) not in units and not (bare_zero and m.group(2) == "" and float(m.group(1)) == 0)):
        raise LinkSpecError(f"bad {kind} {text!r}: expected a number with {expected}")
    return float(m.group(1)) * units.get(m.group(2), 0)


def parse_duration(text: str) -> float:
    """'100ms', '0.2s', '500us' (or '0') -> seconds."""
    return _quantity("rtt", text, _DURATION, "us, ms or s (e.g. 100ms)")


def parse_rate(text: str) -> float:
    """'1gbit', '100mbit', '512kbit', '50MiB/s' (or '0': unlimited) -> bytes per second.
    kbit/mbit/gbit are decimal bits per second, as tc counts them."""
    return _quantity("rate", text, _RATE, "bit, kbit, mbit, gbit (bits/s) or B/s, KiB/s, MiB/s, GiB/s "
                     "(e.g. 1gbit; 0 = unlimited)")


def parse_size(text: str) -> int:
    """'16MiB', '512KiB', '1048576' -> bytes."""
    return int(_quantity("queue", text, _SIZE, "B, KiB, MiB or GiB (e.g. 16MiB)"))


@dataclass(frozen=True)
class LinkSpec:
    rtt: float              # seconds, both ways
    rate: float = 0.0       # bytes per second, per direction; 0 = unlimited
    queue: int = 0          # bottleneck queue in bytes; 0 = the default below

    @property
    def delay(self) -> float:
        return self.rtt / 2

    @property
    def bdp(self) -> int:
        return int(self.rate * self.rtt)

    @property
    def queue_bytes(self) -> int:
        """The bottleneck queue: as given, else one bandwidth-delay product plus 1 MiB."""
        if self.queue:
            return self.queue
        return self.bdp + MiB if self.rate else UNLIMITED_QUEUE

    def text(self) -> str:
        rate = f"{self.rate * 8 / 1e6:g}mbit" if self.rate else "0"
        return f"rtt={self.rtt * 1000:g}ms,rate={rate}" + (f",queue={self.queue}" if self.queue else "")

    def argv(self) -> list[str]:
        return ["--rtt", f"{self.rtt}s", "--rate", f"{self.rate}B/s", "--queue", f"{self.queue_bytes}"]


def parse_link(spec: str) -> LinkSpec:
    """``rtt=100ms,rate=1gbit[,queue=16MiB]`` -> LinkSpec. rtt is required; rate absent or 0
    is unlimited; a bad or unknown field raises LinkSpecError naming it."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in ("rtt", "rate", "queue"):
            raise LinkSpecError(f"bad link field {part!r}: expected rtt=DURATION, rate=RATE or queue=SIZE, "
                                f"e.g. rtt=100ms,rate=1gbit")
        if key in fields:
            raise LinkSpecError(f"link field {key!r} given twice")
        fields[key] = value
    if "rtt" not in fields:
        raise LinkSpecError(f"link spec {spec!r} has no rtt: e.g. rtt=100ms,rate=1gbit")
    return LinkSpec(parse_duration(fields["rtt"]), parse_rate(fields.get("rate", "0")),
                    parse_size(fields["queue"]) if "queue" in fields else 0)


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise LinkSpecError(f"bad address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:2222")
    return host.strip("[]"), int(port)


# -- the relay --------------------------------------------------------------------------
class Pipe:
    """One direction of the link: a serialiser shared by every connection, and its queue."""

    def __init__(self, spec: LinkSpec):
        self.rate, self.delay, self.queue = spec.rate, spec.delay, spec.queue_bytes
        self.cap = spec.queue_bytes + spec.bdp      # what one connection may hold in flight
        self.free_at = 0.0
        self.bytes = 0

    def admit(self, now: float, n: int, not_before: float) -> float:
        """A chunk of *n* bytes read at *now*: the time its last byte arrives at the far end."""
        start = max(now, self.free_at, not_before)
        if self.rate:
            self.free_at = start + n / self.rate
            start = self.free_at
        self.bytes += n
        return start + self.delay

    def drains_at(self, now: float) -> float | None:
        """None while the queue has room, else when it will again."""
        if self.rate and (self.free_at - now) * self.rate > self.queue:
            return self.free_at - self.queue / self.rate
        return None


class Flow:
    """One connection's bytes in one direction: a delay line from a source side to a sink side."""

    def __init__(self, loop, pipe: Pipe, src: Side, not_before: float):
        self.loop, self.pipe, self.src = loop, pipe, src
        self.dst: Side | None = None
        self.not_before = not_before
        self.line: collections.deque = collections.deque()   # (arrive, bytes | None = EOF)
        self.held = 0
        self.timer = None
        self.holds: set[str] = set()         # why the source is paused: "queue", "cap", "sink"
        self.done = False                    # its EOF was delivered

    def push(self, data: bytes | None) -> None:
        now = self.loop.time()
        if data is None:
            last = self.line[-1][0] if self.line else 0.0
            arrive = max(last, now + self.pipe.delay, self.not_before + self.pipe.delay)
        else:
            arrive = self.pipe.admit(now, len(data), self.not_before)
            self.held += len(data)
        self.line.append((arrive, data))
        if self.timer is None:
            self._arm()
        if data is not None:
            if "queue" not in self.holds and (when := self.pipe.drains_at(now)) is not None:
                self.hold("queue")
                self.loop.call_at(when, self.release, "queue")
            if self.held > self.pipe.cap:
                self.hold("cap")

    def hold(self, why: str) -> None:
        if not self.holds:
            self.src.pause()
        self.holds.add(why)

    def release(self, why: str) -> None:
        if why in self.holds:
            self.holds.discard(why)
            if not self.holds:
                self.src.resume()

    def _arm(self) -> None:
        self.timer = self.loop.call_at(self.line[0][0], self.deliver) if self.line else None

    def deliver(self) -> None:
        self.timer = None
        if self.dst is None or self.dst.transport is None:     # the server leg is not up yet
            if self.dst is not None and self.dst.failed:
                return
            self.timer = self.loop.call_later(0.001, self.deliver)
            return
        now = self.loop.time()
        while self.line and self.line[0][0] <= now:
            _, data = self.line.popleft()
            if data is None:
                self.done = True
                self.dst.finish()
                self.src.settle()
            else:
                self.held -= len(data)
                self.dst.write(data)
        if self.held <= self.pipe.cap:
            self.release("cap")
        self._arm()


class Side(asyncio.Protocol):
    """One socket of a relayed connection; what it reads goes out on *out*, a Flow."""

    def __init__(self):
        self.out: Flow | None = None          # the flow it feeds
        self.inbound: Flow | None = None      # the flow that writes to it
        self.transport = None
        self.failed = False                   # (server side) could not be dialled
        self.paused = False
        self.closed = False
        self.eof_sent = False                 # it ended its bytes (EOF or gone)
        self.eof_got = False                  # the other side's EOF reached it

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        if self.paused:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.out.push(data)

    def eof_received(self) -> bool:
        self._end()
        return True            # half-close: the other direction goes on

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._end()

    def _end(self) -> None:
        if not self.eof_sent:
            self.eof_sent = True
            self.out.push(None)

    # flow control: its write buffer is full -> stop reading whoever feeds it
    def pause_writing(self) -> None:
        self.inbound.hold("sink")

    def resume_writing(self) -> None:
        self.inbound.release("sink")

    def pause(self) -> None:
        self.paused = True
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def finish(self) -> None:
        """The other side's EOF arrived: pass the half-close on, or close once both ended."""
        self.eof_got = True
        if not self.settle() and not self.closed and self.transport.can_write_eof():
            self.transport.write_eof()

    def settle(self) -> bool:
        """Close once both directions ended (close flushes what is buffered first)."""
        if self.eof_got and self.out.done:
            if not self.closed:
                self.transport.close()
            return True
        return False


class Relay:
    """Routes (listen -> target, direction) over one pair of Pipes."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self.pipes = {"ab": Pipe(spec), "ba": Pipe(spec)}

    def accept(self, target: tuple[str, int], way: str) -> Side:
        loop = asyncio.get_running_loop()
        now = loop.time()
        up, down = self.pipes[way], self.pipes["ba" if way == "ab" else "ab"]
        client = Side()
        server = Side()
        client.out = Flow(loop, up, client, now + self.spec.rtt)         # after the SYN-ACK came back
        server.out = Flow(loop, down, server, 0.0)
        client.out.dst, server.out.dst = server, client
        server.inbound, client.inbound = client.out, server.out
        loop.call_at(now + self.spec.delay, lambda: loop.create_task(self._dial(target, server, client)))
        return client

    async def _dial(self, target, server: Side, client: Side) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: server, *target)
        except OSError:
            server.failed = True
            if client.transport is not None:
                client.transport.abort()

    async def serve(self, routes: list[tuple[tuple[str, int], tuple[str, int], str]]) -> list[int]:
        loop = asyncio.get_running_loop()
        ports = []
        for listen, target, way in routes:
            srv = await loop.create_server(lambda t=target, w=way: self.accept(t, w), *listen,
                                           reuse_address=True, backlog=256)
            ports.append(srv.sockets[0].getsockname()[1])
        return ports


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.link", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", action="append", required=True, help="HOST:PORT (port 0: any free)")
    ap.add_argument("--to", action="append", required=True, help="HOST:PORT, one per --listen")
    ap.add_argument("--back", action="append", default=[], metavar="LISTEN=TO",
                    help="a route whose client is at the far end (its bytes take the other direction)")
    ap.add_argument("--rtt", required=True, help="round-trip time, e.g. 100ms")
    ap.add_argument("--rate", default="0", help="per direction, e.g. 1gbit, 100mbit (0: unlimited)")
    ap.add_argument("--queue", default="0", help="bottleneck queue, e.g. 16MiB (default: BDP + 1 MiB)")
    args = ap.parse_args(argv)
    if len(args.listen) != len(args.to):
        ap.error("give one --to per --listen")
    try:
        args.spec = LinkSpec(parse_duration(args.rtt), parse_rate(args.rate), parse_size(args.queue))
        args.routes = [(parse_addr(listen), parse_addr(to), "ab") for listen, to in zip(args.listen, args.to, strict=True)]
        for b in args.back:
            listen, eq, to = b.partition("=")
            if not eq:
                raise LinkSpecError(f"bad --back {b!r}: expected LISTEN=TO, e.g. 127.0.0.1:0=127.0.0.1:22")
            args.routes.append((parse_addr(listen), parse_addr(to), "ba"))
    except LinkSpecError as e:
        ap.error(str(e))
    return args


async def _main(args) -> None:
    relay = Relay(args.spec)
    ports = await relay.serve(args.routes)
    print("ready " + " ".join(map(str, ports)), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"bytes ab {relay.pipes['ab'].bytes} ba {relay.pipes['ba'].bytes}", flush=True)


def main(argv=None) -> int:
    asyncio.run(_main(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
