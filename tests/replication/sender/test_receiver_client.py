"""A session that outlives one sync: one SSH login per peer and process, and warm
receivers that answer request after request, through the real sshd and the forced
command. A connection or receiver lost between syncs is replaced transparently."""
import os
import signal
import time
from pathlib import Path

import pytest

from drsvc.errors import InvalidName, ProtocolError, UnknownVerb, UnsupportedVersion
from drsvc.replication import peer_status, sync_unit
from drsvc.replication.wire import frames
from drsvc.replication.sender import receiver_client
from drsvc.replication.sender.receiver_client import reader_for
from drsvc.transport import LinkHints
from drsvc.transport import ssh
from drsvc_lab import wait_until

from ..conftest import make_image, new_sites, sha, write_at

MiB = 1 << 20


def receivers(pool: Path) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"drsvc.replication.receiver" in argv and str(pool).encode() in argv:
                out.add(int(d.name))
    return out


def connections(sshd_pid: int) -> set[int]:
    """sshd's per-connection processes (its children): one per accepted login."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == sshd_pid:
                out.add(int(d.name))
    return out


@pytest.fixture
def site(xfs_mod, sshd_factory):
    a, b = new_sites(xfs_mod)
    s = sshd_factory(b)
    s.primary = a
    make_image(a / "images" / "v.img", 8 * MiB, [(0, os.urandom(8 * MiB))])
    return s


def _sync(site, i):
    """One sync as the worker runs it: a new Peer object built from the same config."""
    a = site.primary
    write_at(a / "images" / "v.img", (i % 100) * 65536, os.urandom(65536))
    peer = site.peer()
    # one channel: the stripe count follows the measured RTT, which a loaded machine raises,
    # and each stripe has a receiver of its own (tests/replication/test_striping.py)
    r = sync_unit(a, "v", ["v"], peer, link=LinkHints(stripes=1))
    peer.close()
    assert sha(site.pool / "images" / "v.img") == sha(a / "images" / "v.img")
    return peer, r


def test_syncs_share_one_login_and_one_receiver(site):
    logins, pids = 0, set()
    for i in range(6):
        peer, r = _sync(site, i)
        logins += peer.connects
        pids |= receivers(site.pool)
        peer_status(site.peer(), "v")
    assert logins == 1, "every sync after the first reuses the cached login"
    assert len(pids) == 1, f"one warm receiver served every request, saw {pids}"
    assert len(connections(site.proc.pid)) == 1
    assert r.phases["connect_s"] < 10


def test_login_socket_sends_small_packets_at_once(site):
    """TCP_NODELAY on the login's socket: a small SSH packet (a record after another,
    the commit after the last record) must not wait for the peer's delayed ACK."""
    import socket
    peer, _ = _sync(site, 0)
    sock = peer.connect().get_transport().sock
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_dropped_connection_between_syncs_is_replaced(site):
    _sync(site, 0)
    (conn,) = connections(site.proc.pid)
    before = receivers(site.pool)
    os.kill(conn, signal.SIGKILL)           # the TCP connection dies with it
    wait_until(lambda: not (receivers(site.pool) & before), 20, "the old receivers to exit")
    peer, _ = _sync(site, 1)                # no error: one fresh login
    assert peer.connects == 1
    assert len(connections(site.proc.pid)) == 1
    peer, _ = _sync(site, 2)
    assert peer.connects == 0


def test_stripes_asking_at_once_share_one_login(site):
    """Stripes dealt to one lane open their channels from threads of their own: the first
    to ask logs in and the rest wait for it (a race made extra logins, each a handshake
    over the WAN, and the losers were dropped)."""
    import threading
    ssh.close_all()
    peers = [site.peer().lane(1) for _ in range(6)]
    go = threading.Barrier(len(peers))

    def ask(p):
        go.wait()
        p.connect()
    threads = [threading.Thread(target=ask, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(p.connects for p in peers) == 1
    assert len({id(p._client) for p in peers}) == 1
    assert len(connections(site.proc.pid)) == 1


def test_killed_receiver_between_syncs_is_replaced(site):
    _sync(site, 0)
    (old,) = receivers(site.pool)
    conn = connections(site.proc.pid)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: old not in receivers(site.pool), 20, "the old receiver to exit")
    peer, _ = _sync(site, 1)
    assert peer.connects == 0, "the login survived; only the receiver is new"
    assert connections(site.proc.pid) == conn
    assert receivers(site.pool) and old not in receivers(site.pool)
    assert peer_status(site.peer(), "v")["generation"] == 2


def test_one_flight_on_a_dead_warm_receiver_starts_a_fresh_one(site):
    """The race the test above can hit under load, made certain: the warm channel a one-flight
    sync takes still looks alive (paramiko has not yet seen its close) but its receiver is
    gone; the begin, the first word on it, is sent once more on a fresh receiver."""
    _sync(site, 0)
    [(chan, _)] = receiver_client._IDLE[site.peer().session_key]
    (old,) = receivers(site.pool)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: chan.chan.closed, 20, "paramiko to see the channel closed")
    chan.alive = lambda: True       # as when it was taken just before the close arrived
    peer, r = _sync(site, 1)
    assert r.channels_opened == 1 and peer.connects == 0
    assert r.round_trips == 1, "still one flight"


def test_changed_known_hosts_forces_a_fresh_checked_login(site, tmp_path):
    _sync(site, 0)
    kh = tmp_path / "known_hosts"
    kh.write_text(site.known_hosts.read_text())
    peer = site.peer(known_hosts=kh)
    peer_status(peer, "v")
    assert peer.connects == 1
    kh.write_text("")        # key un-pinned: the cached login must not be used any more
    from drsvc.errors import PeerUntrusted
    with pytest.raises(PeerUntrusted):
        peer_status(site.peer(known_hosts=kh), "v")


def _serve(site):
    chan = site.peer().open("serve")
    reader = reader_for(site.peer(), chan)
    hello = reader.control("hello")
    # `version` stays the oldest spoken, which a protocol-3 sender accepts; `versions` lists all
    assert hello["version"] == 3 and hello["versions"][-1] == frames.VERSION
    return chan, reader


def _request(chan, verb, *args, version=frames.VERSION):
    chan.send(frames.encode_control({"type": "request", "verb": verb, "args": list(args),
                                       "version": version}))


@pytest.mark.parametrize("verb,args,error", [
    ("sh", ["-c", "id"], UnknownVerb),
    ("serve", [], UnknownVerb),
    ("status", [], ProtocolError),
    ("status", ["../etc"], InvalidName),
])
def test_every_request_is_allowlisted(site, verb, args, error):
    chan, reader = _serve(site)
    try:
        _request(chan, "hello")
        assert reader.control("hello")
        _request(chan, verb, *args)
        with pytest.raises(error):
            reader.control()
        assert chan.exit_status(10) == 2, "a refused request ends the receiver"
    finally:
        chan.close()


def test_a_warm_receiver_imports_numpy_at_its_first_apply(site):
    """A `serve` receiver (the warm set's) imports what a commit imports lazily (numpy, for
    the recovery points' range sets) as its first `apply` begins, while the conversation's
    status and records come: a fresh receiver's first transaction would otherwise pay for it
    between its commit marker and its answer. Until then it does not: most channels of a
    striped sync only carry a stripe, and never commit."""
    before = receivers(site.pool)
    chan, reader = _serve(site)
    try:
        pids = set()
        deadline = time.monotonic() + 30
        while not pids and time.monotonic() < deadline:
            pids = receivers(site.pool) - before
            time.sleep(0.05)
        assert len(pids) == 1, f"one new receiver expected, found {pids}"
        maps = Path(f"/proc/{pids.pop()}/maps")
        _request(chan, "hello")
        assert reader.control("hello")
        assert "_multiarray_umath" not in maps.read_text(), "numpy loaded before any apply"
        _request(chan, "apply")
        chan.send(frames.encode_control({"type": "status", "unit": "v"}))
        assert reader.control()["unit"] == "v"
        while "_multiarray_umath" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "_multiarray_umath" in maps.read_text(), "an apply began, yet numpy is not loaded"
    finally:
        chan.close()


def test_old_protocol_requests_are_refused(site):
    chan, reader = _serve(site)
    try:
        _request(chan, "hello", version=1)
        with pytest.raises(UnsupportedVersion):
            reader.control()
    finally:
        chan.close()
    # and a v1 begin on the one-shot apply verb, as an old sender sends it
    chan = site.peer().open("apply")
    try:
        chan.send(frames.encode_control({"type": "begin", "unit": "v", "version": 1, "txid": "t1",
                                           "kind": "volume", "base": 0, "target": 1, "epoch": 0,
                                           "block_size": 65536, "members": []}))
        with pytest.raises(UnsupportedVersion, match="version 1 is not supported"):
            reader_for(site.peer(), chan).control()
    finally:
        chan.close()


def test_warm_receivers_are_bounded(site):
    sessions = [receiver_client.ApplySession(site.peer(), f"u{i}") for i in range(receiver_client.MAX_IDLE + 2)]
    for s in sessions:
        s.request_status()
        s.read_status()
    for s in sessions:
        s.close()
    wait_until(lambda: len(receivers(site.pool)) == receiver_client.MAX_IDLE, 20, "MAX_IDLE warm receivers")
    assert receiver_client.discard_idle(site.peer().session_key) == receiver_client.MAX_IDLE
    wait_until(lambda: not receivers(site.pool), 20, "no receiver left")
    ssh.close_all()


def test_warm_leaves_every_stripe_of_a_large_sync_warm(site):
    """remote.warm (a worker at start, workers.main.keep_peers_warm) logs in on every connection
    striping uses and greets a receiver for the master and each stripe: the first striped sync
    then opens no channel and no login."""
    from drsvc.transport import LinkHints
    link = LinkHints(stripes=4, connections=2)
    peer = site.peer()
    peer.link = link
    warmed = receiver_client.warm(peer)["warm"]
    assert warmed == {0: 2, 1: 2}, "the master and stripe 1 on connection 0, stripes 0 and 2 on 1"
    assert len(connections(site.proc.pid)) == 2
    write_at(site.primary / "images" / "v.img", 0, os.urandom(6 * MiB))
    sync_peer = site.peer()
    sync_peer.link = link
    r = sync_unit(site.primary, "v", ["v"], sync_peer, link=link)
    assert r.stripes == 4
    assert r.channels_opened == 0, "every stripe found a warm receiver"
    assert sync_peer.connects == 0 and len(connections(site.proc.pid)) == 2
    assert sha(site.pool / "images" / "v.img") == sha(site.primary / "images" / "v.img")
    for i in range(2):
        receiver_client.discard_idle(peer.lane(i).session_key)
    ssh.close_all()


def test_saved_report_counts_the_round_trips(site):
    """The report kept in state.json (what `drsvc status` and the failover bench read) counts
    the round trips and fresh channels of the attempt that adopted, as the returned one does."""
    from drsvc.replication.common.unit_state import find_state
    _sync(site, 1)
    _, r = _sync(site, 2)
    saved = find_state(site.primary, "v").reports[-1]
    assert r.round_trips >= 1
    assert (saved["round_trips"], saved["channels_opened"]) == (r.round_trips, r.channels_opened)
