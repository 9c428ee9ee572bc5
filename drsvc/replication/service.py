"""The composition point of replication: one site's requests and jobs, built whole.

    requests  (plugin)   validate, claim the unit, dispatch   drsvc.replication.requests
    jobs      (worker)   the task bodies: talk to the peer     drsvc.replication.jobs
    status    (anyone)   the read model over the pool          drsvc.replication.status
    peers     (jobs)     peer config -> transport.Peer         drsvc.replication.peers

The status read model needs neither a dispatcher nor a peer: drsvc.site.Site
builds it for every process. This module adds the parts that do.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import SiteConfig
from ..dispatch import Dispatcher
from ..transport import Peer
from .jobs import ReplicationJobs
from .peers import PeerFactory
from .requests import ReplicationRequests
from .status import ReplicationStatus


@dataclass(frozen=True)
class Replication:
    requests: ReplicationRequests
    jobs: ReplicationJobs


def build(cfg: SiteConfig, status: ReplicationStatus, dispatcher: Dispatcher, *, volumes, groups, node,
          connect: Callable[[str], Peer] | None = None, rpc_wait: float = 20.0) -> Replication:
    """*connect* (peer name -> Peer) replaces the config's transports in tests."""
    peers = PeerFactory(cfg, connect)
    return Replication(
        requests=ReplicationRequests(status, cfg, dispatcher, volumes=volumes, node=node, rpc_wait=rpc_wait),
        jobs=ReplicationJobs(cfg, status.pool, volumes=volumes, groups=groups, node=node, peers=peers,
                             dispatcher=dispatcher))
