"""Atomicity under faults: the TCP connection is cut, the receiver or the sender is
SIGKILLed, at random points (55 kills in all). After each, once the peer has been
contacted again, the replica equals a complete generation (old or new), the next
sync converges, and an interrupted large delta resumes instead of restarting."""
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from drsvc import store
from drsvc.errors import DrsvcError
from drsvc.replication import peer_status, sync_unit
from drsvc.replication.sender.progress import progress_of
from drsvc.layout import PoolLayout
from drsvc.replication.sender.base_store import generation_image
from drsvc.replication.common.unit_state import get_state
from drsvc.transport.local import LocalPeer
from tests.fixtures.maps import replica_maps
from tests.fixtures.xfs import free_port, need

from .conftest import make_image, new_sites, sha, write_at

pytestmark = pytest.mark.faults
MiB = 1 << 20
IMG = 16 * MiB


class CuttingProxy:
    """TCP proxy to sshd that resets both sides after `cut` client->server bytes."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.port = free_port()
        self.cut = None
        self.cuts = 0
        self.lsock = socket.create_server(("127.0.0.1", self.port))
        self.lsock.settimeout(0.2)
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                c, _ = self.lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(c, s, self.cut), daemon=True).start()

    def _pump(self, c, s, cut):
        import select
        sent = 0
        socks = [c, s]
        try:
            while True:
                r, _, _ = select.select(socks, [], [], 30)
                if not r:
                    break
                for src in r:
                    data = src.recv(65536)
                    if not data:
                        raise EOFError
                    dst = s if src is c else c
                    if src is c and cut is not None:
                        if sent + len(data) >= cut:
                            dst.sendall(data[:cut - sent])
                            self.cuts += 1
                            raise EOFError
                        sent += len(data)
                    dst.sendall(data)
        except (EOFError, OSError):
            pass
        finally:
            for x in (c, s):
                try:
                    x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                    x.close()
                except OSError:
                    pass

    def close(self):
        self.stop = True
        self.lsock.close()


def _change(img, rnd, nbytes):
    """Rewrite `nbytes` of the image in random 64 KiB pieces."""
    for _ in range(nbytes // (64 << 10)):
        write_at(img, rnd.randrange(0, IMG // 4096) * 4096 % (IMG - (64 << 10)), rnd.randbytes(64 << 10))


def _check_after_fault(a, b, peer, old, gen_before):
    """Contact the peer (replays a committed journal), then the replica must be a whole
    generation; returns the sha it had."""
    st = get_state(a, "v")
    # the attempt's generation: pending, or already acked if the sync got through
    lay = PoolLayout(a)
    new = None
    for g in (st.generation + 1, st.generation):
        meta = store.read_doc(lay.snap_dir("v", g) / "meta.json")
        if meta and meta.get("complete") and g > gen_before:
            # overlay capture: a pending generation's image is its base rolled forward
            with tempfile.TemporaryDirectory(dir=a) as scratch:
                new = sha(generation_image(lay, "v", g, "v", scratch))
            break
    peer_status(peer, "v")
    got = sha(b / "images" / "v.img")
    assert got in (old, new), "replica is a mix of generations"
    assert replica_maps(b, "v") in ("exact", "unused")      # never maps that claim what is not
    return got


def _converge(a, b, peer):
    r = sync_unit(a, "v", ["v"], peer)
    assert sha(b / "images" / "v.img") == sha(a / "images" / "v.img")
    assert replica_maps(b, "v") in ("exact", "unused")
    return r


def _seed(root, peer_factory):
    a, b = new_sites(root)
    img = a / "images" / "v.img"
    make_image(img, IMG, [(0, os.urandom(IMG))])
    peer = peer_factory(b)
    sync_unit(a, "v", ["v"], peer)
    return a, b, img, peer


def test_cut_tcp_connection(xfs_mod, sshd_factory):
    """24 connection cuts at random byte counts through a proxy in front of sshd."""
    need("mkfs.xfs")
    rnd = random.Random(0xC07)
    a, b = new_sites(xfs_mod)
    site = sshd_factory(b)
    img = a / "images" / "v.img"
    make_image(img, IMG, [(0, os.urandom(IMG))])
    direct = site.peer()
    sync_unit(a, "v", ["v"], direct)
    proxy = CuttingProxy(site.port)
    proxy_kh = site.dir / "known_hosts.proxy"   # the same pinned key, under the proxy's address
    proxy_kh.write_text(f"[127.0.0.1]:{proxy.port} {site.host_pub}\n")
    resumed = []
    try:
        for _i in range(24):
            _change(img, rnd, 3 * MiB)
            old = sha(b / "images" / "v.img")
            gen = get_state(a, "v").generation
            proxy.cut = rnd.randrange(2000, 3 * MiB + 200_000)
            cut_peer = site.peer(port=proxy.port, known_hosts=proxy_kh, io_timeout=20)
            try:
                sync_unit(a, "v", ["v"], cut_peer)
            except DrsvcError:
                pass
            finally:
                cut_peer.close()
            _check_after_fault(a, b, direct, old, gen)
            r = _converge(a, b, direct)
            if r.resumed and r.records_sent < r.records:
                resumed.append((r.records_sent, r.records, r.bytes_on_wire))
    finally:
        proxy.close()
    assert proxy.cuts >= 20
    # cuts in the middle of the stream resume after what the receiver journaled. How much it
    # had journaled depends on how far sshd and the receiver had read when the reset came (a
    # reset drops what the kernel still held unread): most cuts on an idle machine, few on a
    # loaded one. The resume's exact arithmetic is test_striping's (records sent = records -
    # held); this test's claim is that no cut tears the replica, and that cuts do resume.
    assert resumed, "no cut transfer resumed after what the receiver had journaled"
    assert all(wire < 3 * MiB for _, _, wire in resumed)


def _kill_later(peer, delay, killed, before, began=None):
    """Wait for this sync's receiver to start (and, given *began*, for that file: the
    transaction's begin), then kill it after `delay`."""
    deadline = time.monotonic() + 5
    while peer.last_proc is before and time.monotonic() < deadline:
        time.sleep(0.002)
    while began is not None and not began.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    p = peer.last_proc
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGKILL)
        killed.append(p.pid)


def test_kill_receiver_at_random_times(xfs_mod):
    """16 SIGKILLs of the receiver process at random instants of a throttled sync: half
    timed from the receiver's start, half from the transaction's begin (on a loaded host
    the sender's capture can outlast the first kind's delay, so only the second is sure
    to land in the stream)."""
    rnd = random.Random(0xDEAD)
    a, b, img, peer = _seed(xfs_mod, LocalPeer)
    began = PoolLayout(b).journal_dir("v") / "tx.json"
    killed = []
    resumed = 0
    for i in range(16):
        _change(img, rnd, 4 * MiB)
        old = sha(b / "images" / "v.img")
        gen = get_state(a, "v").generation
        t = threading.Thread(target=_kill_later, args=(peer, rnd.uniform(0.0, 0.4), killed, peer.last_proc,
                                                       began if i % 2 else None))
        t.start()
        try:
            sync_unit(a, "v", ["v"], peer, bwlimit=8 * MiB)
        except DrsvcError:
            pass
        t.join()
        _check_after_fault(a, b, peer, old, gen)
        r = _converge(a, b, peer)
        resumed += r.resumed and r.records_sent < r.records
    assert len(killed) >= 12
    # resume itself is asserted deterministically by the cut tests
    assert resumed >= 1


@pytest.mark.parametrize("ack", ["durable", "applied"])
@pytest.mark.parametrize("point", ["receiver.before_commit", "receiver.after_commit_marker",
                                   "receiver.mid_apply", "receiver.after_apply", "receiver.after_state"])
def test_kill_receiver_at_commit_points(xfs_mod, point, ack):
    """kill -9 at each commit point of the single-write apply (data.bin ranges reflinked
    into the image); mid_apply leaves the image a mix of generations until the next
    contact replays the committed journal. A peer that acks at its commit marker answers
    before the apply: a kill in it fails nothing, and the generation is acked."""
    a, b, img, _ = _seed(xfs_mod, LocalPeer)
    old = sha(b / "images" / "v.img")
    gen = get_state(a, "v").generation
    write_at(img, 5 * MiB, os.urandom(MiB))
    write_at(img, 12 * MiB, os.urandom(256 << 10))     # a second record: mid_apply lands between
    faulty = LocalPeer(b, env={"DRSVC_FAILPOINTS": point})
    faulty.ack = ack
    answered = ack == "durable" and point not in ("receiver.before_commit", "receiver.after_commit_marker")
    if answered:
        assert sync_unit(a, "v", ["v"], faulty).target_generation == gen + 1
    else:
        with pytest.raises(DrsvcError):
            sync_unit(a, "v", ["v"], faulty)
    faulty.last_proc.wait(timeout=30)
    assert faulty.last_proc.returncode == -signal.SIGKILL      # the failpoint was reached
    got = _check_after_fault(a, b, LocalPeer(b), old, gen)
    # once the commit marker is durable, the next contact completes the generation
    assert (got != old) == (point != "receiver.before_commit")
    r = _converge(a, b, LocalPeer(b))
    if answered:            # the status before it replayed the journal: nothing was pending
        assert r.steps == ["sync"] and r.records == 0
    elif point != "receiver.before_commit":
        assert r.steps == ["finalize", "sync"] and r.records == 0


SENDER = """
import sys
from drsvc.replication import sync_unit
from drsvc.transport.local import LocalPeer
print("ready", flush=True)
sync_unit(sys.argv[1], "v", ["v"], LocalPeer(sys.argv[2]), bwlimit=float(sys.argv[3]))
"""


def _sender_proc(a, b, env=None, bw=12 * MiB):
    p = subprocess.Popen([sys.executable, "-c", SENDER, str(a), str(b), str(bw)],
                         env=dict(os.environ, **(env or {})), stderr=subprocess.DEVNULL,
                         stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"   # imports done; the sync starts now
    return p


def _stream_started(a, p, timeout=60.0) -> None:
    """Until the sender's stream has begun (its progress file is written as the first
    record leaves), or the sender has ended."""
    deadline = time.monotonic() + timeout
    while progress_of(a, "v") is None and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def test_kill_sender_at_random_times(xfs_mod):
    """10 SIGKILLs of the sending process (which holds the unit lock) at random instants:
    half measured from its start (capture, plan or stream), half from its stream's start,
    so that a loaded machine, whose captures run slower, still kills mid-stream."""
    rnd = random.Random(0x5E4D)
    a, b, img, peer = _seed(xfs_mod, LocalPeer)
    mid_sync = 0
    for i in range(10):
        _change(img, rnd, 4 * MiB)
        old = sha(b / "images" / "v.img")
        gen = get_state(a, "v").generation
        p = _sender_proc(a, b, bw=8 * MiB)
        if i % 2:
            _stream_started(a, p)
            time.sleep(rnd.uniform(0.0, 0.4))      # 4 MiB at 8 MiB/s: the stream lasts 0.5 s
        else:
            time.sleep(rnd.uniform(0.05, 0.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        # killed with a generation in flight: its intent is on disk. The next sync resumes it,
        # or, for a delta pipelined behind an 8 MiB/s link (``prepare._wire_bound``), drops it
        mid_sync += (get_state(a, "v").generation == gen
                     and (PoolLayout(a).snap_dir("v", gen + 1) / "meta.json").exists())
        _check_after_fault(a, b, peer, old, gen)
        _converge(a, b, peer)
    assert mid_sync >= 4, f"only {mid_sync} of 10 kills had a generation in flight"


def test_kill_sender_after_peer_commit(xfs_mod):
    a, b, img, peer = _seed(xfs_mod, LocalPeer)
    write_at(img, 0, os.urandom(MiB))
    p = _sender_proc(a, b, env={"DRSVC_FAILPOINTS": "sender.after_commit"}, bw=1 << 40)
    assert p.wait() == -signal.SIGKILL
    assert peer_status(peer, "v")["generation"] == 2 and get_state(a, "v").generation == 1
    r = _converge(a, b, peer)
    assert r.steps == ["finalize", "sync"] and get_state(a, "v").generation == 3


GROUP_SENDER = """
import sys
from drsvc.replication import sync_unit
from drsvc.transport.local import LocalPeer
sync_unit(sys.argv[1], "g", ["v", "w"], LocalPeer(sys.argv[2]))
"""


def test_kill_sender_mid_plan_of_a_generation_on_the_wire(xfs_mod):
    """A first copy's records leave while its plan still reads the images (the pipelined
    prepare), its intent (snap/1) recorded first. A sender killed between two members' plans,
    with the first member's records on the wire, leaves that intent with its plan not whole;
    the peer commits nothing of it. The next sync plans it again from the captured images
    (``prepare.replan``) and resumes the same txid: what the peer journaled is not sent
    again, and the images match. (A first copy that restarted from zero after a kill is what
    took the first pipelined prepare back, at stop 30.)"""
    a, b = new_sites(xfs_mod)
    vols = ("v", "w")
    for v in vols:
        make_image(a / "images" / f"{v}.img", 4 * IMG, [(0, os.urandom(4 * IMG))])
    p = subprocess.Popen([sys.executable, "-c", GROUP_SENDER, str(a), str(b)], stderr=subprocess.DEVNULL,
                         env=dict(os.environ, DRSVC_FAILPOINTS="sender.mid_plan"))
    assert p.wait(timeout=120) == -signal.SIGKILL
    intent = store.read_doc(PoolLayout(a).snap_dir("g", 1) / "meta.json")
    assert intent["replan"] and not intent.get("complete"), intent
    assert peer_status(LocalPeer(b), "g")["generation"] == 0
    r = sync_unit(a, "g", list(vols), LocalPeer(b))
    assert r.steps == ["resume"] and r.resumed and r.target_generation == 1, r.steps
    assert r.records_sent <= r.records
    for v in vols:
        assert sha(b / "images" / f"{v}.img") == sha(a / "images" / f"{v}.img")


GROUP_DELTA_SENDER = """
import sys
from drsvc.replication import sync_unit
from drsvc.transport.local import LocalPeer
sync_unit(sys.argv[1], "g", ["v", "w"], LocalPeer(sys.argv[2]), bwlimit=float(sys.argv[3]))
"""


def test_a_link_bound_delta_is_pipelined_and_dropped_when_its_sender_dies_mid_plan(xfs_mod):
    """A delta whose bytes take long on the wire at the rate the config states (here the
    sync's bandwidth limit) leaves while its plan still reads the changed blocks, as a first
    copy does. Its plan cannot be made again from what was captured (a delta's overlay
    depends on the base), so a sender killed between two members' plans leaves an intent
    the next sync drops: the peer committed nothing of it, and the next sync sends a fresh
    generation that makes both images equal. Without a rate, a delta is planned first."""
    a, b = new_sites(xfs_mod)
    rnd = random.Random(0xDE17A)
    vols = ("v", "w")
    imgs = {v: a / "images" / f"{v}.img" for v in vols}
    for v in vols:
        make_image(imgs[v], IMG, [(0, os.urandom(IMG))])
    peer = LocalPeer(b)
    assert sync_unit(a, "g", list(vols), peer).target_generation == 1
    for v in vols:
        _change(imgs[v], rnd, 2 * MiB)
    r = sync_unit(a, "g", list(vols), peer)
    assert not r.pipelined, "no rate configured: the delta is planned before it is sent"
    for v in vols:
        _change(imgs[v], rnd, 2 * MiB)
    r = sync_unit(a, "g", list(vols), peer, bwlimit=8 * MiB)     # ~4 MiB at 8 MiB/s: 0.5 s on the wire
    # ... and one channel will do (a local peer): its records leave as the capture clones
    assert r.pipelined and r.early and r.stripes == 1 and r.target_generation == 3, r
    for v in vols:
        assert sha(b / "images" / f"{v}.img") == sha(imgs[v])

    for v in vols:
        _change(imgs[v], rnd, 2 * MiB)
    p = subprocess.Popen([sys.executable, "-c", GROUP_DELTA_SENDER, str(a), str(b), str(8 * MiB)],
                         stderr=subprocess.DEVNULL, env=dict(os.environ, DRSVC_FAILPOINTS="sender.mid_plan"))
    assert p.wait(timeout=120) == -signal.SIGKILL
    intent = store.read_doc(PoolLayout(a).snap_dir("g", 4) / "meta.json")
    assert intent is not None and not intent["replan"] and not intent.get("complete"), intent
    assert peer_status(peer, "g")["generation"] == 3
    r = sync_unit(a, "g", list(vols), peer)
    assert r.steps == ["sync"] and r.target_generation == 4 and not r.resumed, r.steps
    for v in vols:
        assert sha(b / "images" / f"{v}.img") == sha(imgs[v])
    assert replica_maps(b, "g") in ("exact", "unused")
