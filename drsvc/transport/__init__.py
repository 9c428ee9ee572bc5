"""The peer interface: a way to run one receiver verb on the peer site and talk to it.

Transports (ssh, local) only move bytes; the protocol lives in drsvc.replication.
Importing this package never imports paramiko (drsvc.transport.ssh does).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .bandwidth import Bandwidth, TokenBucket

__all__ = ["WINDOW", "Bandwidth", "Channel", "LimitedChannel", "LinkHints", "Peer", "TokenBucket"]

WINDOW = 2 << 20     # the channel window OpenSSH's sshd grants (its default, and HPN-SSH's floor)


@dataclass(frozen=True)
class LinkHints:
    """What the site config says of the path to a peer (``[peers.<name>]``), for striping:
    ``rate`` in bytes/s (0: unknown), the peer's channel ``window``, how many
    ``connections`` stripes may spread over, ``max_stripes``, and ``stripes`` to fix the
    count (0: from the measured RTT and the rate)."""
    rate: float = 0.0
    window: int = WINDOW
    connections: int = 2
    max_stripes: int = 16
    stripes: int = 0


class Channel(ABC):
    """A bidirectional byte stream to one receiver process."""

    bytes_sent: int = 0

    @abstractmethod
    def send(self, data) -> None:
        """Send all of *data*; raises PeerUnreachable when the connection is gone."""

    @abstractmethod
    def recv(self, n: int) -> bytes:
        """Up to *n* bytes; b"" at end of stream."""

    @abstractmethod
    def close_write(self) -> None:
        """Signal end of input to the receiver."""

    @abstractmethod
    def close(self) -> None:
        ...

    def exit_status(self, timeout: float = 5.0) -> int | None:
        return None

    def alive(self) -> bool:
        """False once the channel is known to be closed (a warm channel is then not reused)."""
        return True

    def buffered(self) -> bool:
        """Whether a recv would return at once: bytes, or the end, have arrived. False when
        the transport cannot tell."""
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Peer(ABC):
    """A replication peer. One Peer is reused for every verb and member of a sync.

    A transport whose connections outlive one sync gives a ``session_key`` (what
    its connection was authenticated with): drsvc.replication.sender.receiver_client then keeps
    receivers warm per key and sends each request to one (the ``serve`` verb).
    None (the default) runs one receiver process per request.
    """

    name: str = "peer"
    session_key = None
    link: LinkHints = LinkHints()
    # when the peer answers a sync's commit: "durable" (its journal and commit marker are
    # durable; the apply follows the answer) or "applied" (the replica is at the generation)
    ack: str = "durable"

    def lane(self, i: int) -> Peer:
        """The peer over its i-th connection (0: this one). A transport with one connection
        (or none kept) answers itself: every lane shares it."""
        return self

    def rtt(self, wait: float = 0.0) -> float | None:
        """The measured round trip to the peer in seconds, or None while unknown (waiting
        up to *wait* seconds for a measurement under way). A local peer: 0."""
        return 0.0

    @abstractmethod
    def open(self, verb: str, *args: str) -> Channel:
        """Start the receiver with this verb and return its channel."""

    def close(self) -> None:  # noqa: B027 - a transport without connections has nothing to close
        """Let go of the peer (a cached connection may stay for the next sync)."""

    def drop(self) -> None:  # noqa: B027
        """Forget a connection that failed, so the next open makes a fresh one."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LimitedChannel(Channel):
    """Wraps a channel with a limit on what it sends (a ``Bandwidth``: every stripe of one
    sync wraps its channel around the same one)."""

    def __init__(self, inner: Channel, bucket: Bandwidth):
        self.inner, self.bucket = inner, bucket

    @property
    def bytes_sent(self):
        return self.inner.bytes_sent

    def send(self, data) -> None:
        mv = memoryview(data)
        step = 64 << 10
        for i in range(0, len(mv), step):
            part = mv[i:i + step]
            self.bucket.take(len(part))
            self.inner.send(part)

    def recv(self, n):
        return self.inner.recv(n)

    def close_write(self):
        self.inner.close_write()

    def close(self):
        self.inner.close()

    def exit_status(self, timeout: float = 5.0):
        return self.inner.exit_status(timeout)
