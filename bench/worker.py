"""A warm sync worker for the bench: one long-lived process that runs sync after sync.

    python -m bench.worker --socket PATH --port N --key K --known-hosts F

It keeps what a Celery worker process keeps between tasks (the imported engine,
the cached SSH connections and warm receivers, warmed at start by ``receiver_client.warm`` as
``workers.main.keep_peers_warm`` does), so a sync's wall time is what a worker
spends on it. Requests and replies are JSON lines on a unix socket:
{"pool", "unit", "members"?} -> {"wall_s", "report", "rss"} or {"error"}.
The parent side is :class:`SyncWorker`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from drsvc import runner
from drsvc.errors import Unavailable

from .harness import run_rsync
from .rss import vm_hwm

REPO = Path(__file__).resolve().parents[1]       # `-m bench.worker` wherever the bench runs from


def serve(args) -> None:
    from drsvc.replication import sync_unit
    from drsvc.transport.ssh import SshPeer
    from drsvc.replication.sender import warm
    from drsvc.transport import LinkHints
    peer = SshPeer("127.0.0.1", port=args.port, key_file=args.key, known_hosts=args.known_hosts)
    if args.link_rate:
        peer.link = LinkHints(rate=args.link_rate)       # the [peers.X] link_rate an operator sets
    peer.ack = args.ack                                  # the [peers.X] ack
    t = time.monotonic()
    warmed = warm(peer)["warm"]      # as workers.main.keep_peers_warm does at start
    warm = {"s": round(time.monotonic() - t, 3), "receivers": {str(k): v for k, v in warmed.items()},
            "rtt_s": peer.rtt()}
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(args.socket)
    srv.listen(1)
    conn, _ = srv.accept()
    f = conn.makefile("rwb")
    f.write(json.dumps({"warm": warm}).encode() + b"\n")
    f.flush()
    for line in f:
        req = json.loads(line)
        t = time.monotonic()
        try:
            rep = sync_unit(req["pool"], req["unit"], req.get("members") or [req["unit"]], peer,
                            roll_behind=args.roll == "behind")
            out = {"wall_s": time.monotonic() - t, "report": rep.to_dict(), "rss": vm_hwm(os.getpid())}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the bench
            out = {"error": f"{type(e).__name__}: {e}"}
        finally:
            peer.close()          # as a job does; the connection stays cached in the process
        f.write(json.dumps(out).encode() + b"\n")
        f.flush()


class SyncWorker:
    """The parent's handle on a bench worker process (a context manager)."""

    def __init__(self, site, sock_dir: Path, *, link_rate: float = 0.0, ack: str = "applied",
                 roll: str = "inline"):
        self.site, self.link_rate, self.ack, self.roll = site, link_rate, ack, roll
        self.path = Path(sock_dir) / f"worker-{os.getpid()}-{time.monotonic_ns()}.sock"
        self.proc = None
        self.f = None

    def __enter__(self) -> SyncWorker:
        self.proc = runner.spawn([sys.executable, "-m", "bench.worker", "--socket", self.path,
                                  "--port", self.site.port, "--key", self.site.client_key,
                                  "--known-hosts", self.site.known_hosts,
                                  "--link-rate", str(self.link_rate), "--ack", self.ack,
                                  "--roll", self.roll], cwd=REPO)
        deadline = time.monotonic() + 60
        s = socket.socket(socket.AF_UNIX)
        while True:
            try:
                s.connect(str(self.path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise Unavailable("the bench worker did not start") from None
                time.sleep(0.02)
        self.sock = s
        self.f = s.makefile("rwb")
        self.warm = json.loads(self.f.readline() or b"{}").get("warm")
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def sync(self, pool, unit: str, members=None) -> dict:
        self.f.write(json.dumps({"pool": str(pool), "unit": unit, "members": members}).encode() + b"\n")
        self.f.flush()
        line = self.f.readline()
        if not line:
            raise Unavailable("the bench worker died")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"sync of {unit} failed: {out['error']}")
        if self.ack == "durable":
            out["report"]["phases"].update(self._after_answer(unit))
        if self.roll == "behind":
            out["report"]["phases"].update(self._after_return(pool, unit))
        return out

    @staticmethod
    def _after_return(pool, unit: str) -> dict:
        """The base rolled behind the sync's return: wait for it before anything else is
        timed (phase ``roll_behind_wait_s``, the part of it left once the reply got here)."""
        from drsvc.layout import PoolLayout
        from drsvc.replication.sender import wait_for_roll
        t = time.monotonic()
        wait_for_roll(PoolLayout(pool), unit)
        return {"roll_behind_wait_s": round(time.monotonic() - t, 4)}

    def _after_answer(self, unit: str) -> dict:
        """A durable ack: wait for the peer's apply before anything else is timed, and take
        what followed the answer from the peer's receive record (phases ``peer_after_*``)."""
        from drsvc.layout import PoolLayout
        from drsvc.replication.common import find_state
        from drsvc.replication.receiver import wait_for_applies
        t = time.monotonic()
        wait_for_applies(PoolLayout(self.site.pool))
        got = {"peer_after_wait_s": round(time.monotonic() - t, 4)}
        st = find_state(self.site.pool, unit)
        after = (st.received[-1] if st is not None and st.received else {}).get("after_answer") or {}
        got.update({f"peer_after_{k}": v for k, v in after.items()})
        return got

    def __exit__(self, *exc):
        try:
            self.f.close()
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - make sure it is gone
                self.proc.kill()
                self.proc.wait()
            self.path.unlink(missing_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.worker")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--known-hosts", required=True)
    ap.add_argument("--link-rate", type=float, default=0.0, help="the peer's link_rate (bytes/s; 0: unset)")
    ap.add_argument("--ack", choices=("applied", "durable"), default="durable", help="the peer's ack")
    ap.add_argument("--roll", choices=("behind", "inline"), default="behind",
                    help="the base rolls forward after the sync returns, as a worker's job syncs, or before")
    serve(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())


@contextlib.contextmanager
def case_worker(ctx, res):
    """A fresh warm worker for one case: warm as a production worker is (``receiver_client.warm`` at
    its start: every connection logged in, a receiver greeted for the master and each
    stripe), then a sync of the warm-up unit (untimed); the peak RSS of the worker and of
    the receivers serving it go to *res*."""
    from .rss import PeakRss, receiver_of
    rate = ctx.link.rate if ctx.link is not None else 0.0     # set as the README tells operators to
    with PeakRss(receiver_of(ctx.b)) as rr, SyncWorker(ctx.site, ctx.tmp, link_rate=rate, ack=ctx.args.ack,
                                                        roll=ctx.args.roll) as w:
        res.extra["warm"] = w.warm
        out = w.sync(ctx.a, ctx.warmup_unit)
        res.extra["warmup_connect_s"] = round(out["report"]["phases"].get("connect_s", 0.0), 4)
        try:
            yield w
        finally:
            res.rss["sender"] = max(res.rss["sender"], vm_hwm(w.pid))
    res.rss["receiver"] = max(res.rss["receiver"], rr.peak)


def seed_copy(ctx, img: Path) -> None:
    """The copy a delta case starts from, untimed and over loopback (not through --link):
    a sync in a worker of its own, and a reflink copy for rsync."""
    with SyncWorker(ctx.direct or ctx.site, ctx.tmp) as d:
        d.sync(ctx.a, img.stem)
    if not ctx.args.no_rsync:
        runner.run(["cp", "--reflink=auto", img, ctx.rsync_dest(img)])     # another XFS: a copy


def seed(ctx, w, img: Path) -> None:
    """A case's initial copy (untimed): in its worker and by rsync through the site, as on
    LAN; with --link over loopback instead (seed_copy)."""
    if ctx.link is not None:
        seed_copy(ctx, img)
        return
    w.sync(ctx.a, img.stem)
    if not ctx.args.no_rsync:
        run_rsync(ctx.site, img, ctx.rsync_dest(img), ["--whole-file", "--inplace"])
