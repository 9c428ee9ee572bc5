"""Striping at the sender: how many channels a transaction takes, and those channels.

One SSH session channel carries at most its window per round trip (sshd grants 2 MiB:
~20 MiB/s at 100 ms, whatever the link). A large transaction over a long path is
therefore spread over N channels: the apply channel (the master) and N - 1 ``stripe``
channels, dealt over the peer's connections (``Peer.lane``), each a warm receiver that
hands its stream to the master (``stripe_join``). See docs/design/sender.md, "The striped stream".

    N = ceil(1.25 x rate x RTT / window), capped by max_stripes

RTT is the connection's measured round trip (``Peer.rtt``); rate is the peer's
``link_rate``, else the sync's bandwidth limit, else 1 Gbit/s. A transaction whose
planned bytes fit in one window (an idle or small sync) stays on one channel, as does
every transaction with a peer that speaks protocol 3.
"""
from __future__ import annotations

import math

from ...transport import LinkHints

DEFAULT_RATE = 1e9 / 8       # bytes/s assumed when neither link_rate nor a bandwidth limit is set
HEADROOM = 1.25              # stripes beyond the bandwidth-delay product: windows refill a trip late
MIN_PER_STRIPE = 1 << 20     # never a stripe for less than this much of the plan


def stated_rate(link: LinkHints, bwlimit: float | None = None) -> float:
    """The path's rate as the config states it (bytes/s; 0: not stated): the peer's
    ``link_rate``, else the sync's bandwidth limit."""
    return float(link.rate or bwlimit or 0.0)


def stripe_count(planned: int, *, rtt: float | None, link: LinkHints, bwlimit: float | None = None) -> int:
    """How many channels (the master included) a transaction of *planned* bytes takes."""
    if link.stripes:
        return max(1, min(link.stripes, link.max_stripes or link.stripes))
    if planned <= link.window or not rtt or link.max_stripes <= 1:
        return 1
    rate = stated_rate(link, bwlimit) or DEFAULT_RATE
    n = math.ceil(HEADROOM * rate * rtt / link.window)
    return max(1, min(n, link.max_stripes, max(1, planned // MIN_PER_STRIPE)))


def one_channel(planned: int, *, rtt: float | None, link: LinkHints, bwlimit: float | None = None) -> bool:
    """Whether a transaction of *planned* bytes will go on one channel, as ``stripe_count``
    would decide it; False while the RTT it needs is unknown."""
    if not link.stripes and planned <= link.window:
        return True
    if rtt is None and not link.stripes:
        return False
    return stripe_count(planned, rtt=rtt, link=link, bwlimit=bwlimit) == 1
