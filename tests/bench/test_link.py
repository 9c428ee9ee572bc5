"""The link emulator (bench/link.py): what it guarantees, on real sockets through its own process.

The parsers' tests are in the fast tier (no root, no lab, no process); the others start
the emulator's process. These test the emulator's pacing, not drsvc: a round trip through it takes at least
one RTT (a lower bound it enforces), bytes arrive intact and in order under
concurrency, several connections share one rate (the measured/configured ratio in a
generous band), its queue is bounded (back-pressure reaches the sender), and bad
link specs are refused with a message that says what is expected.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from bench.link import LinkSpec, LinkSpecError, parse_link
from bench.wan import LinkProcess, Server, Sink, raw_push

MiB = 1 << 20


class Echo(Server):
    """Sends back what it reads."""

    def handle(self, conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(1 << 20, n - len(buf)))
        assert chunk, f"connection closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


@pytest.mark.fast
def test_parse_link_reads_rtt_rate_and_queue():
    assert parse_link("rtt=100ms,rate=1gbit") == LinkSpec(0.1, 125e6, 0)
    spec = parse_link(" rtt=0.2s , rate=100mbit, queue=16MiB ")
    assert spec == LinkSpec(0.2, 12.5e6, 16 * MiB) and spec.queue_bytes == 16 * MiB
    assert parse_link("rtt=50ms,rate=50MiB/s").rate == 50 * MiB
    assert parse_link("rtt=500us,rate=512kbit").rate == 64000
    unlimited = parse_link("rtt=10ms")
    assert unlimited.rate == 0 and parse_link("rtt=10ms,rate=0").rate == 0
    assert unlimited.queue_bytes == 64 * MiB                      # rate 0: a bound on what one connection holds
    assert parse_link("rtt=100ms,rate=1gbit").queue_bytes == int(125e6 * 0.1) + MiB    # BDP + 1 MiB
    assert parse_link(spec.text()) == spec                        # the text form reads back


@pytest.mark.fast
@pytest.mark.parametrize("spec, words", [
    ("rate=1gbit", "has no rtt"),
    ("rtt=100,rate=1gbit", "bad rtt '100': expected a number with us, ms or s"),
    ("rtt=100ms,rate=1gb", "bad rate '1gb': expected a number with bit, kbit, mbit, gbit"),
    ("rtt=100ms,rate=-5mbit", "bad rate '-5mbit'"),
    ("rtt=100ms,rate=fast", "bad rate 'fast'"),
    ("rtt=100ms,loss=1%", "bad link field 'loss=1%': expected rtt=DURATION, rate=RATE or queue=SIZE"),
    ("rtt=100ms,rtt=200ms", "given twice"),
    ("rtt=100ms,queue=lots", "bad queue 'lots': expected a number with B, KiB, MiB or GiB"),
    ("100ms", "bad link field '100ms'"),
])
def test_bad_link_specs_are_refused_with_what_is_expected(spec, words):
    with pytest.raises(LinkSpecError, match=words.replace("(", r"\(")):
        parse_link(spec)


def test_the_cli_refuses_a_bad_spec_with_the_same_message():
    res = subprocess.run([sys.executable, "-m", "bench.link", "--listen", "127.0.0.1:0", "--to", "127.0.0.1:9",
                          "--rtt", "100ms", "--rate", "1gb"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "bad rate '1gb'" in res.stderr
    res = subprocess.run([sys.executable, "-m", "bench.delta_vs_rsync", "--link", "rtt=fast"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--link: bad rtt 'fast'" in res.stderr


def test_a_round_trip_takes_at_least_one_rtt_and_set_up_one_more():
    spec = LinkSpec(0.08, 0.0)
    with Echo() as echo, LinkProcess(spec, [echo.port]) as link:
        t = time.monotonic()
        with socket.create_connection(("127.0.0.1", link.ports[0]), timeout=30) as s:
            s.sendall(b"x")
            assert recv_exactly(s, 1) == b"x"
            first = time.monotonic() - t
            for _ in range(3):
                t = time.monotonic()
                s.sendall(b"y")
                assert recv_exactly(s, 1) == b"y"
                assert time.monotonic() - t >= spec.rtt
    assert first >= 2 * spec.rtt          # the handshake's RTT, then the echo's


def test_bytes_arrive_intact_and_in_order_under_concurrency():
    spec = LinkSpec(0.02, 40e6)
    payloads = [os.urandom(3 * MiB + i * 4099) for i in range(8)]
    got: list = [None] * len(payloads)
    with Echo() as echo, LinkProcess(spec, [echo.port]) as link:
        def one(i):
            with socket.create_connection(("127.0.0.1", link.ports[0]), timeout=60) as s:
                sender = threading.Thread(target=s.sendall, args=(payloads[i],))
                sender.start()
                got[i] = recv_exactly(s, len(payloads[i]))
                sender.join()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(payloads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(g == p for g, p in zip(got, payloads, strict=True))
    assert link.bytes["ab"] == link.bytes["ba"] == sum(map(len, payloads))


def test_connections_share_the_one_rate():
    """4 connections at once through a 40 Mbit/s link: together they get the link's rate, not 4 x."""
    spec = LinkSpec(0.02, 5e6)
    each = 4 * MiB
    with Sink() as sink, LinkProcess(spec, [sink.port]) as link:
        threads = [threading.Thread(target=raw_push, args=(link.ports[0], sink, each)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with sink.done:
            assert sink.done.wait_for(lambda: len(sink.results) == 4, timeout=60)
        results = list(sink.results)
    assert len(results) == 4 and all(n == each for n, *_ in results)
    start = min(first for _, first, _, _ in results)
    first_len = min(results, key=lambda r: r[1])[3]
    span = max(last for _, _, last, _ in results) - start
    # the span starts at the sink's first read, which a loaded machine can delay past the
    # first bytes' arrival: a little over the rate is that, 4 connections at 4x would be 4.0
    assert 0.8 <= (4 * each - first_len) / span / spec.rate <= 1.1


def test_the_queue_is_bounded_and_pushes_back_on_the_sender():
    """A sender into a 8 Mbit/s link cannot hand over much more than the queue and the socket
    buffers in half a second: without back-pressure loopback would take hundreds of MiB."""
    spec = LinkSpec(0.02, 1e6)
    with Sink() as sink, LinkProcess(spec, [sink.port]) as link:
        s = socket.create_connection(("127.0.0.1", link.ports[0]), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        s.setblocking(False)
        block, sent = b"\0" * (1 << 16), 0
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                sent += s.send(block)
            except BlockingIOError:
                time.sleep(0.005)
        s.close()
    bound = spec.queue_bytes + spec.rate * 0.6 + 4 * MiB     # queue, what drained, the kernel's buffers
    assert 0 < sent <= bound, (sent, bound)
