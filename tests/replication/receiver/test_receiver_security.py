"""Security against the real sshd on loopback: pinned host keys, a key bound to the
receiver, and streams that must be whole, intact and based on the replica."""
import io
import os
import uuid

import paramiko
import pytest

from drsvc.errors import (BaseMismatch, HostKeyMismatch, PeerAuthFailed, PeerUntrusted,
                          ProtocolError, StreamCorrupt, UnknownVerb)
from drsvc.replication import peer_status, sync_unit
from drsvc.replication.wire import frames
from drsvc.replication.wire.frames import FrameReader
from drsvc.replication.sender.receiver_client import ApplySession
from tests.fixtures.sshd import keygen
from tests.fixtures.xfs import need

from ..conftest import make_image, new_sites, sha, write_at

MiB = 1 << 20


@pytest.fixture
def site(xfs_mod, sshd_factory):
    need("mkfs.xfs")
    a, b = new_sites(xfs_mod)
    s = sshd_factory(b)
    s.primary = a
    return s


def test_host_key_mismatch_is_refused(site, tmp_path):
    other = keygen(tmp_path / "other_host")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{site.port} {other}\n")
    with pytest.raises(HostKeyMismatch) as e:
        peer_status(site.peer(known_hosts=kh), "v")
    assert "does not match" in str(e.value)


def test_unknown_host_key_is_refused(site, tmp_path):
    kh = tmp_path / "empty_known_hosts"
    kh.write_text("")
    with pytest.raises(PeerUntrusted) as e:
        peer_status(site.peer(known_hosts=kh), "v")
    assert not isinstance(e.value, HostKeyMismatch)


def test_unknown_client_key_is_refused(site, tmp_path):
    keygen(tmp_path / "intruder")
    with pytest.raises(PeerAuthFailed):
        peer_status(site.peer(key_file=tmp_path / "intruder"), "v")


def _run(client: paramiko.SSHClient, command: str) -> tuple[bytes, int]:
    chan = client.get_transport().open_session()
    chan.settimeout(20)
    chan.exec_command(command)
    chan.shutdown_write()
    out = b""
    while True:
        b = chan.recv(65536)
        if not b:
            break
        out += b
    return out, chan.recv_exit_status()


def _rejection(out: bytes) -> dict:
    ftype, body = FrameReader(io.BytesIO(out).read).next_frame()
    assert ftype == frames.T_CONTROL
    return frames.parse_control(body)


@pytest.mark.parametrize("command", ["id", "sh -c id", "status u; id", "status $(id)", "apply x",
                                     "hashes ../../etc 4096", "release .."])
def test_key_runs_only_the_receiver(site, command):
    client = site.peer().connect()
    out, rc = _run(client, command)
    assert b"uid=" not in out and rc != 0
    msg = _rejection(out)
    assert msg["type"] == "error" and msg["error"] in ("UnknownVerb", "ProtocolError", "InvalidName")


def test_no_shell_no_sftp_no_forwarding(site):
    client = site.peer().connect()
    t = client.get_transport()
    # an interactive shell: restrict forbids the pty, and the forced command still runs
    try:
        chan = client.invoke_shell()
        chan.settimeout(20)
        chan.send(b"id\n")
        out = b""
        while (b := chan.recv(65536)):
            out += b
        assert b"uid=" not in out and b"UnknownVerb" in out
    except paramiko.SSHException:
        pass
    # the sftp subsystem is overridden by the forced command: the client meets our
    # receiver's error frame, not an sftp server
    with pytest.raises((paramiko.SSHException, paramiko.SFTPError, EOFError, OSError)):
        client.open_sftp()
    with pytest.raises(paramiko.ChannelException):
        t.open_channel("direct-tcpip", ("127.0.0.1", site.port), ("127.0.0.1", 0), timeout=10)
    with pytest.raises(paramiko.SSHException):
        t.request_port_forward("127.0.0.1", 0)
    assert t.is_active()


def test_receiver_verb_allowlist_direct():
    from drsvc.replication.receiver.program import parse_command
    with pytest.raises(UnknownVerb):
        parse_command(["bash"])
    with pytest.raises(UnknownVerb):
        parse_command([])
    with pytest.raises(ProtocolError):
        parse_command(["status"])
    assert parse_command(["status", "u"]) == ("status", ["u"])


def test_receiver_command_line():
    """The forced command's own arguments: the pool is required, options come before the
    verb's words (a verb's argument that looks like an option is the verb's), anything else
    is a usage error (exit 2), never a traceback."""
    from drsvc.replication.receiver.program import Usage, main, parse_argv
    assert parse_argv(["--pool", "/p"]) == ("/p", None, [])
    assert parse_argv(["--pool=/p", "--connect", "/s", "status", "--pool"]) == ("/p", "/s", ["status", "--pool"])
    for bad in ([], ["--pool"], ["--connect", "/s"], ["--pool", "/p", "--bogus"]):
        with pytest.raises(Usage):
            parse_argv(bad)
    assert main(["--bogus"]) == 2


def _synced(site):
    a = site.primary
    make_image(a / "images" / "v.img", 4 * MiB, [(0, os.urandom(2 * MiB))])
    peer = site.peer()
    sync_unit(a, "v", ["v"], peer)
    return a, peer, sha(site.pool / "images" / "v.img")


def _tx(base=1, target=2, size=4 * MiB):
    return {"txid": uuid.uuid4().hex, "kind": "volume", "base": base, "target": target, "epoch": 0,
            "block_size": 4096, "mode": "delta",
            "members": [{"volume_id": "v", "size": size, "base_size": 4 * MiB, "fresh": False}]}


def _record(offset, data, *, checksum=None):
    ck = frames.payload_checksum(data) if checksum is None else checksum
    return frames.encode_record(0, frames.CODEC_RAW, offset, len(data), ck, data), ck


def test_corrupted_record_is_rejected_replica_intact(site):
    a, peer, before = _synced(site)
    s = ApplySession(peer, "v")
    try:
        s.begin(_tx())
        frame, _ = _record(0, os.urandom(4096), checksum=12345)
        s.send(frame)
        with pytest.raises(StreamCorrupt):
            s.commit(1, "00" * 16)
    finally:
        s.close()
    assert sha(site.pool / "images" / "v.img") == before
    assert peer_status(peer, "v")["generation"] == 1


def test_truncated_stream_is_not_applied(site):
    a, peer, before = _synced(site)
    s = ApplySession(peer, "v")
    s.begin(_tx())
    frame, _ = _record(0, os.urandom(8192))
    s.send(frame + frame[:100])   # one whole record, then half of one; no commit
    s.chan.close()
    st = peer_status(peer, "v")
    assert st["generation"] == 1 and st["journal"] and not st["journal"]["committed"]
    assert sha(site.pool / "images" / "v.img") == before
    # the next real sync discards that journal (different txid) and converges
    write_at(a / "images" / "v.img", 0, b"new")
    sync_unit(a, "v", ["v"], peer)
    assert sha(site.pool / "images" / "v.img") == sha(a / "images" / "v.img")
    assert peer_status(peer, "v")["journal"] is None


def test_manifest_mismatch_is_rejected(site):
    a, peer, before = _synced(site)
    s = ApplySession(peer, "v")
    try:
        s.begin(_tx())
        frame, ck = _record(4096, os.urandom(4096))
        s.send(frame)
        chain = frames.ManifestChain()
        chain.update(0, False, 8192, 4096, ck)   # the trailer names a record we never sent
        with pytest.raises(StreamCorrupt):
            s.commit(1, chain.hexdigest())
    finally:
        s.close()
    assert sha(site.pool / "images" / "v.img") == before


def test_wrong_base_is_refused(site):
    a, peer, before = _synced(site)
    s = ApplySession(peer, "v")
    try:
        with pytest.raises(BaseMismatch):
            s.begin(_tx(base=5, target=6))
    finally:
        s.close()
    assert sha(site.pool / "images" / "v.img") == before


def test_record_beyond_image_is_rejected(site):
    a, peer, before = _synced(site)
    s = ApplySession(peer, "v")
    try:
        s.begin(_tx())
        frame, _ = _record(4 * MiB, os.urandom(4096))
        s.send(frame)
        with pytest.raises(StreamCorrupt):
            s.commit(1, "00" * 16)
    finally:
        s.close()
    assert sha(site.pool / "images" / "v.img") == before


def test_the_soon_verb_asks_only_a_primary_and_once(site):
    """``soon UNIT`` over the replication key (the secondary's resync or repair asking its
    primary for the next sync now): a replica held as secondary here is not asked, an
    unknown or malformed id is refused by name, and a primary's scheduler gets one mark
    until it takes it."""
    from drsvc.errors import InvalidName, UnitNotFound
    from drsvc.replication.common import unit_state
    from drsvc.replication.sender.receiver_client import ask_soon
    from drsvc.schedule_changes import take_soon
    _a, peer, _ = _synced(site)
    got = ask_soon(peer, "v")
    assert got["asked"] is False and "secondary" in got["reason"]
    with pytest.raises(UnitNotFound):
        ask_soon(peer, "w")
    with pytest.raises(InvalidName):
        ask_soon(peer, "../v")
    unit_state.promote(site.pool, "v")
    assert ask_soon(peer, "v")["asked"] is True
    assert ask_soon(peer, "v")["asked"] is False
    assert take_soon(site.pool) == ["v"]
