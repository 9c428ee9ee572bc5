"""The bench over an emulated WAN (--link): the emulator's process, routes through it, floors.

* :class:`LinkProcess` starts ``python -m bench.link`` through drsvc.runner with one
  route per target port (and --back routes, dialled from the far site) and yields
  the ports to dial instead.
* :func:`through` gives a bench site reached through such a port: the same keys,
  a known_hosts pinning the same host key at the new port. :func:`route_lab_peer`
  does the same to a drsvc_lab site's config (its [peers.X] port and known_hosts).
* :func:`add_floors`: a case's floor over the link, wire bytes / rate + 1 RTT per
  run (wire bytes as drsvc's report counts them), the data floor (changed / rate +
  RTT), and the ratios of drsvc's and rsync's medians to the floor.
* :func:`wan_ceilings` (beside `full`): a raw TCP push through the same emulator to
  a sink in this process, timed by the sink from its first byte to its last (what
  the emulator itself delivers, beside the link's rate), and 1 and 8 paramiko
  channels of one connection pushing to a discarding sink at the peer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import select
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from drsvc import runner
from drsvc.errors import Unavailable

from .harness import MiB, CaseResult, stats
from .link import LinkSpec

REPO = Path(__file__).resolve().parents[1]


class LinkProcess:
    """The link emulator in its own process (a context manager); ``ports`` in route order:
    the --to targets first, then the --back ones."""

    def __init__(self, spec: LinkSpec, targets, back=()):
        self.spec, self.targets, self.back = spec, list(targets), list(back)
        self.proc = None
        self.ports: list[int] = []
        self.bytes: dict = {}

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "bench.link", *self.spec.argv()]
        for port in self.targets:
            argv += ["--listen", "127.0.0.1:0", "--to", f"127.0.0.1:{port}"]
        for port in self.back:
            argv += ["--back", f"127.0.0.1:0=127.0.0.1:{port}"]
        return argv

    def __enter__(self) -> LinkProcess:
        self.proc = runner.spawn(self.argv(), stdout=runner.PIPE, cwd=REPO)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline().decode() if ready else ""
        if not line.startswith("ready "):
            self.__exit__()
            raise Unavailable(f"the link emulator did not start: {line.strip() or 'no answer in 30 s'}")
        self.ports = [int(p) for p in line.split()[1:]]
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            out = self.proc.communicate(timeout=10)[0].decode()
        except Exception:  # noqa: BLE001 - it must not outlive the bench
            self.proc.kill()
            out = self.proc.communicate()[0].decode()
        if m := re.search(r"bytes ab (\d+) ba (\d+)", out):
            self.bytes = {"ab": int(m.group(1)), "ba": int(m.group(2))}


def through(site, port: int):
    """*site* (a bench.site.BenchSite) as reached through *port*: its host key pinned there."""
    kh = Path(site.dir) / f"known_hosts-{port}"
    kh.write_text(Path(site.known_hosts).read_text().replace(f"]:{site.port} ", f"]:{port} "))
    return dataclasses.replace(site, port=port, known_hosts=kh)


def route_lab_peer(site, peer: str, old_port: int, new_port: int, *, link_rate: float = 0.0) -> None:
    """Make a drsvc_lab site dial its peer *peer* at *new_port*: the [peers.<peer>] port
    of its config and the port its known_hosts pins the peer's host key at; *link_rate*
    (bytes/s) sets the peer's ``link_rate``, as the README tells operators to."""
    cfg = Path(site.config_path)
    text = cfg.read_text()
    block = re.search(rf"\[peers\.{re.escape(peer)}\]\n(?:[^\[].*\n)*", text)
    if block is None or f"port = {old_port}\n" not in block.group(0):
        raise ValueError(f"{cfg} has no [peers.{peer}] at port {old_port}")
    routed = block.group(0).replace(f"port = {old_port}\n", f"port = {new_port}\n")
    if link_rate:
        routed = routed.replace(f"port = {new_port}\n", f"port = {new_port}\nlink_rate = {int(link_rate)}\n")
    cfg.write_text(text[:block.start()] + routed + text[block.end():])
    kh = Path(re.search(r'known_hosts = "([^"]+)"', routed).group(1))
    kh.write_text(kh.read_text().replace(f"]:{old_port} ", f"]:{new_port} "))


def add_floors(res: CaseResult, spec: LinkSpec) -> CaseResult:
    """The case's floors over the link and the ratios to them, into res.extra["link"]."""
    def over(nbytes):
        return (nbytes / spec.rate if spec.rate else 0.0) + spec.rtt
    floors = [over(w) for w in res.drsvc_wire]
    out = {"rtt_s": spec.rtt, "rate_bytes_s": spec.rate, "spec": spec.text(),
           "floor_s": stats(floors), "data_floor_s": stats([over(c) for c in res.changed]),
           "x_floor": round(statistics.median(res.drsvc) / statistics.median(floors), 2),
           "rsync_x_floor": round(statistics.median(res.rsync) / statistics.median(floors), 2)
           if res.rsync else None}
    res.extra["link"] = out
    return res


class Server:
    """A TCP server on loopback, a thread per connection running handle(conn) (a context manager)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def handle(self, conn) -> None:
        raise NotImplementedError

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def __enter__(self):
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


class Sink(Server):
    """Reads and discards; per connection it records (bytes, time of its first read, of its
    last, bytes of the first read)."""

    def __init__(self):
        super().__init__()
        self.results: list[tuple[int, float, float, int]] = []
        self.done = threading.Condition()

    def handle(self, conn) -> None:
        buf = bytearray(4 * MiB)
        n = first_len = 0
        first = last = 0.0
        with conn:
            while k := conn.recv_into(buf):
                last = time.monotonic()
                if not n:
                    first, first_len = last, k
                n += k
        with self.done:
            self.results.append((n, first, last, first_len))
            self.done.notify_all()


def raw_push(port: int, sink: Sink, nbytes: int) -> float:
    """MiB/s of one raw TCP connection pushing *nbytes* to *sink* through *port* (one push
    at a time: the sink's latest result is taken as this push's)."""
    block = memoryview(os.urandom(4 * MiB))
    want = len(sink.results) + 1
    with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
        left = nbytes
        while left:
            s.sendall(block[:min(left, len(block))])
            left -= min(left, len(block))
    with sink.done:
        if not sink.done.wait_for(lambda: len(sink.results) >= want, timeout=300):
            raise Unavailable("the sink behind the link emulator got no end of the push")
        n, first, last, first_len = sink.results[-1]
    if n != nbytes:
        raise RuntimeError(f"the sink counted {n} bytes, {nbytes} were pushed")
    return (n - first_len) / (last - first) / MiB


@contextlib.contextmanager
def bench_link(spec: LinkSpec | None, site):
    """For the bench's pool cases: (the site as drsvc and rsync reach it, the emulator's
    process and the raw-push sink behind it); without a spec, (site, None, None)."""
    if spec is None:
        yield site, None, None
        return
    with Sink() as sink, LinkProcess(spec, [site.port, sink.port]) as link:
        yield through(site, link.ports[0]), link, sink


def wan_ceilings(site, link: LinkProcess, sink: Sink, *, runs: int, nbytes: int) -> dict:
    """Beside `full` over the link: the emulator's raw ceiling, and N paramiko channels of one
    connection pushing to a discarding sink through it (N = 1 and 8: the striping target)."""
    from .ceilings import paramiko_channels
    emu: list[float] = []
    chans: dict[str, list[float]] = {"1": [], "8": []}
    for _ in range(runs):
        emu.append(raw_push(link.ports[1], sink, nbytes))
        for n, got in chans.items():
            got.append(paramiko_channels(site, int(n), nbytes))
    return {"bytes": nbytes, "link_mib_s": round(link.spec.rate / MiB, 1),
            "emulator_mib_s": round(statistics.median(emu), 1),
            "paramiko_mib_s": {n: round(statistics.median(v), 1) for n, v in chans.items()},
            "runs": {"emulator": [round(x, 1) for x in emu], **{f"paramiko_{n}": [round(x, 1) for x in v]
                                                                 for n, v in chans.items()}}}
