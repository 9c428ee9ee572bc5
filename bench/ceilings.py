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
        for _ in range(nbytes // MiB):
            chan.send(block)
        chan.close_write()
        out = b""
        while piece := chan.recv(1 << 16):
            out += piece
        dt = time.monotonic() - t
    finally:
        chan.close()
        peer.drop()
    return _sink_rate(out, nbytes, dt)


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
    per = [(p.get("precopy_s", 0.0), p.get("adopt_s", 0.0), r) for p, r in zip(phases, ranges, strict=True) if r]
    if per:
        # precopy includes its FIEMAP of the image: the figure is an upper bound per clone
        out["precopy_us_per_range"] = round(statistics.median(p / r for p, _, r in per) * 1e6, 1)
        out["adopt_us_per_range"] = round(statistics.median(a / r for _, a, r in per) * 1e6, 1)
    return out


def channel_text(ch: dict) -> str:
    """One line of a ``channel`` result (JSON lines written before disk_write lack it)."""
    disk = f"; the peer's pool writes {ch['disk_write_mb_s']:.0f} MB/s" if "disk_write_mb_s" in ch else ""
    return f"an SSH channel alone: {ch['drsvc_mb_s']:.0f} MB/s drsvc's, {ch['openssh_mb_s']:.0f} MB/s OpenSSH's{disk}"


def extents_text(ec: dict) -> str:
    """One line of an ``extent_costs`` result."""
    per = (f", {ec['ranges_cloned']} ranges cloned at <= {ec['precopy_us_per_range']:.0f} us (capture) and "
           f"{ec['adopt_us_per_range']:.0f} us (adopt) each" if "adopt_us_per_range" in ec else "")
    return f"image of {ec['extents']} extents, one FIEMAP {ec['fiemap_s']:.3f} s{per}"
