"""The peer factory: a [peers.<name>] table in the site config -> a drsvc.transport.Peer.

The table's ``transport`` key (default "ssh") picks the builder. A second
transport is one module behind ``drsvc.transport.Peer``/``Channel`` plus one
entry here and its keys in ``drsvc.config.TRANSPORT_KEYS``. Transport modules
are imported only when a peer of that kind is built (paramiko stays out of
processes that never connect).
"""
from __future__ import annotations

from collections.abc import Callable

from ...config import PeerConfig, SiteConfig
from ...errors import ConfigInvalid
from ...transport import LinkHints, Peer


def _ssh(p: PeerConfig) -> Peer:
    from ...transport.ssh import SshPeer
    return SshPeer(p.host, port=p.port, user=p.user, key_file=p.key, known_hosts=p.known_hosts, name=p.name)


def _local(p: PeerConfig) -> Peer:
    from ...transport.local import LocalPeer
    return LocalPeer(p.pool, name=p.name)


TRANSPORTS: dict[str, Callable[[PeerConfig], Peer]] = {"ssh": _ssh, "local": _local}


def connect(p: PeerConfig) -> Peer:
    """A new, unconnected Peer for *p* (transports connect on first use)."""
    build = TRANSPORTS.get(p.transport)
    if build is None:
        raise ConfigInvalid(where=f"peer {p.name}", reason=f"unknown transport {p.transport!r}; known: {sorted(TRANSPORTS)}")
    peer = build(p)
    peer.link = link_of(p)
    peer.ack = p.ack
    return peer


def link_of(p: PeerConfig) -> LinkHints:
    """The striping hints of a [peers.<name>] table."""
    return LinkHints(rate=p.link_rate, window=p.window, connections=p.connections, max_stripes=p.max_stripes,
                     stripes=p.stripes)


class PeerFactory:
    """Peers of one site by name. *connect* (name -> Peer) replaces the config in tests."""

    def __init__(self, cfg: SiteConfig, connect: Callable[[str], Peer] | None = None):
        self.cfg = cfg
        self._connect = connect

    def __call__(self, name: str) -> Peer:
        if self._connect is not None:
            return self._connect(name)
        return connect(self.cfg.peer(name))
