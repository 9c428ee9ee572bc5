"""The peer factory picks the transport named by [peers.<name>].transport (default ssh)."""
from pathlib import Path

import pytest

from drsvc.config import PeerConfig, parse
from drsvc.errors import ConfigInvalid, PeerNotFound, PeerRequired
from drsvc.replication.control.peers import TRANSPORTS, PeerFactory, connect
from drsvc.transport.local import LocalPeer
from drsvc.transport.ssh import SshPeer

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so

BASE = {"site": "a", "pool": "/srv/pool"}


def test_ssh_is_the_default_transport_and_paths_are_relative_to_the_config():
    cfg = parse({**BASE, "peers": {"b": {"host": "10.0.0.2", "known_hosts": "kh", "key": "k"}}},
                Path("/etc/drsvc/site.toml"))
    p = cfg.peer("b")
    assert isinstance(p, PeerConfig) and p.transport == "ssh" and p.known_hosts == Path("/etc/drsvc/kh")
    peer = PeerFactory(cfg)("b")
    assert isinstance(peer, SshPeer) and peer.name == "b" and peer.host == "10.0.0.2"
    assert peer._client is None          # built, not connected


def test_local_transport_needs_only_the_peer_pool():
    cfg = parse({**BASE, "peers": {"b": {"transport": "local", "pool": "/srv/pool-b"}}})
    peer = connect(cfg.peer())
    assert isinstance(peer, LocalPeer) and peer.pool == Path("/srv/pool-b") and peer.name == "b"


@pytest.mark.parametrize("table,needle", [
    ({"transport": "carrier-pigeon"}, "unknown transport 'carrier-pigeon'"),
    ({"host": "h", "key": "k"}, "missing key 'known_hosts'"),
    ({"transport": "local"}, "missing key 'pool'"),
    ({"transport": "local", "pool": "/p", "max_syncs": -1}, "max_syncs must be a whole number"),
    ({"transport": "local", "pool": "/p", "max_syncs": "2"}, "max_syncs must be a whole number"),
])
def test_bad_peer_tables_are_refused_at_load(table, needle):
    with pytest.raises(ConfigInvalid, match=needle):
        parse({**BASE, "peers": {"b": table}})


def test_every_config_transport_has_a_builder():
    from drsvc.config import TRANSPORT_KEYS
    assert set(TRANSPORT_KEYS) == set(TRANSPORTS)


def test_peer_lookup_errors_are_named():
    cfg = parse({**BASE, "peers": {n: {"transport": "local", "pool": f"/p/{n}"} for n in ("b", "c")}})
    with pytest.raises(PeerRequired, match="has 2 peers"):
        cfg.peer()
    with pytest.raises(PeerNotFound):
        cfg.peer("z")
    injected = PeerFactory(cfg, connect=lambda name: LocalPeer("/x", name=f"t-{name}"))
    assert injected("b").name == "t-b"


def test_per_peer_sync_slots():
    """With several peers, one peer holds at most all but one worker process
    (max_syncs overrides); with one peer there is no cap."""
    one = parse({**BASE, "peers": {"b": {"transport": "local", "pool": "/p"}}})
    assert one.peer_sync_slots("b", 2) == 0
    two = parse({**BASE, "peers": {"b": {"transport": "local", "pool": "/p"},
                                   "c": {"transport": "local", "pool": "/q", "max_syncs": 3}}})
    assert two.peer_sync_slots("b", 2) == 1 and two.peer_sync_slots("b", 8) == 7
    assert two.peer_sync_slots("c", 2) == 3
    assert two.queue_for("sync") == "drsvc.a" and two.queue_for("demote") == "drsvc.a.control"
