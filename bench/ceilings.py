"""Ceilings measured in the same run as the cases: what the machine and kernel allow.

A goal can sit below what the parts drsvc stands on can do here. These figures
say where, measured beside the case they bound (never asserted on):

* ``channel``: bytes pushed through an SSH channel to a process on the peer that
  discards them, with nothing else to do: drsvc's transport (the same SshPeer
  code, ciphers and window a sync uses) and OpenSSH's client (the transport
  rsync uses), both to the bench's sshd. A full copy cannot stream faster than
  its channel.
* ``disk_write``: a sequential write of the same size into the replica's pool,
  then fsync: what any full copy must do at the peer, whatever carries it.
* ``extent_costs``: the live image's extent count and the time of one FIEMAP of
  it (what an overlay capture must map, the aged case's bound), and the cost per
  range of the capture's and the adopt's FICLONERANGE, from the sync's phases.
"""
from __future__ import annotations

import fcntl
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from drsvc import runner

from .site import rsync_ssh

MiB = 1 << 20
CHANNEL_BYTES = 512 * MiB
# The peer side: widen its stdin pipe as the receiver does, count and discard.
SINK = ("import fcntl, os\n"
        "try:\n    fcntl.fcntl(0, fcntl.F_SETPIPE_SZ, 1 << 20)\nexcept OSError:\n    pass\n"
        "n = 0\nwhile b := os.read(0, 1 << 20):\n    n += len(b)\nprint(n)\n")


def _sink_rate(out: bytes, nbytes: int, seconds: float) -> float:
    """MB/s of a channel run, once the sink's count says every byte arrived."""
    if int(out or b"0") != nbytes:
        raise RuntimeError(f"the sink counted {out!r} bytes, {nbytes} were sent")
    return nbytes / seconds / 1e6


def _drsvc_channel(site, nbytes: int) -> float:
    from drsvc.transport.ssh import SshPeer
    peer = SshPeer("127.0.0.1", port=site.port, key_file=site.plain_key, known_hosts=site.known_hosts)
    chan = peer.open(sys.executable, "-c", SINK)
    try:
        block = memoryview(os.urandom(MiB))
        t = time.monotonic()
        out = _push(chan, block, nbytes)
        dt = time.monotonic() - t
    finally:
        chan.close()
        peer.drop()
    return _sink_rate(out, nbytes, dt)


def _push(chan, block: memoryview, nbytes: int) -> bytes:
    """Send *nbytes* (whole MiB blocks) down *chan* to the SINK, then read what it counted."""
    for _ in range(nbytes // MiB):
        chan.send(block)
    chan.close_write()
    out = b""
    while piece := chan.recv(1 << 16):
        out += piece
    return out


def paramiko_channels(site, n: int, nbytes: int) -> float:
    """MiB/s of *n* channels of one paramiko connection (drsvc's SshPeer), each pushing
    nbytes / n to its own SINK at once: what striping one sync over n channels could reach."""
    from drsvc.transport.ssh import SshPeer
    peer = SshPeer("127.0.0.1", port=site.port, key_file=site.plain_key, known_hosts=site.known_hosts)
    each = nbytes // n // MiB * MiB
    chans = [peer.open(sys.executable, "-c", SINK) for _ in range(n)]
    block = memoryview(os.urandom(MiB))
    outs: list = [None] * n
    try:
        def run(i):
            outs[i] = _push(chans[i], block, each)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        t = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dt = time.monotonic() - t
    finally:
        for c in chans:
            c.close()
        peer.drop()
    for out in outs:
        _sink_rate(out, each, dt)
    return n * each / dt / MiB


def _openssh_channel(site, nbytes: int) -> float:
    cmd = rsync_ssh(site).split() + ["root@127.0.0.1", f"{sys.executable} -c '{SINK}'"]
    proc = runner.spawn(cmd, stdin=runner.PIPE, stdout=runner.PIPE)
    try:
        fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
        block = os.urandom(MiB)
        t = time.monotonic()
        for _ in range(nbytes // MiB):
            proc.stdin.write(block)
        proc.stdin.close()
        out = proc.stdout.read()
        proc.wait(timeout=60)
        dt = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return _sink_rate(out, nbytes, dt)


def _disk_write(directory: Path, nbytes: int) -> float:
    path = directory / f".ceiling-{os.getpid()}"
    block = os.urandom(MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t = time.monotonic()
        for _ in range(nbytes // MiB):
            os.write(fd, block)
        os.fsync(fd)
        dt = time.monotonic() - t
    finally:
        os.close(fd)
        path.unlink()
    return nbytes / dt / 1e6


def channel(site, *, runs: int = 3, nbytes: int = CHANNEL_BYTES) -> dict:
    """Median MB/s of drsvc's SSH channel and of OpenSSH's, to a discarding sink, and of
    a sequential write (and fsync) of as many bytes into the replica's pool."""
    ours, theirs, disk = [], [], []
    for _ in range(runs):
        ours.append(_drsvc_channel(site, nbytes))
        theirs.append(_openssh_channel(site, nbytes))
        disk.append(_disk_write(Path(site.pool), nbytes))
    return {"bytes": nbytes, "drsvc_mb_s": round(statistics.median(ours), 1),
            "openssh_mb_s": round(statistics.median(theirs), 1),
            "disk_write_mb_s": round(statistics.median(disk), 1),
            "runs": {"drsvc": [round(x, 1) for x in ours], "openssh": [round(x, 1) for x in theirs],
                     "disk_write": [round(x, 1) for x in disk]}}


def extent_costs(image: Path, phases: list[dict], ranges: list[int]) -> dict:
    """The image's extent count and one FIEMAP of it; per-range clone costs of the syncs."""
    from drsvc.host.fiemap import fiemap_array
    fd = os.open(image, os.O_RDONLY)
    try:
        t = time.monotonic()
        n = len(fiemap_array(fd, os.fstat(fd).st_size))
        fiemap_s = time.monotonic() - t
    finally:
        os.close(fd)
    out = {"extents": n, "fiemap_s": round(fiemap_s, 4),
           "ranges_cloned": int(statistics.median(ranges)) if ranges else 0}
    # the base's reflinks: rolled ahead beside the stream (preroll_s), else in the adopt
    per = [(p.get("precopy_s", 0.0), p.get("preroll_s") or p.get("adopt_s", 0.0), r)
           for p, r in zip(phases, ranges, strict=True) if r]
    if per:
        # precopy includes its FIEMAP of the image: the figure is an upper bound per clone
        out["precopy_us_per_range"] = round(statistics.median(p / r for p, _, r in per) * 1e6, 1)
        out["adopt_us_per_range"] = round(statistics.median(a / r for _, a, r in per) * 1e6, 1)
    return out
