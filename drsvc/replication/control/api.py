"""The control plane as the rest of drsvc calls it.

- :func:`build`: one site's requests (the plugin's side: validate, claim the unit,
  dispatch) and jobs (the worker's side: the task bodies, which talk to the peer), built
  whole. The read model (``read_model.ReplicationStatus``) needs neither a dispatcher nor
  a peer: drsvc.site.Site builds it for every process.
- :class:`ReplicationAPI`: the Replication RPCs by (kind, id), what the CSI-Addons
  Replication servicer calls, answered over this process's pool (a one-node site, or a
  storage node running its site controller's call); drsvc.cluster.ClusterReplication
  sends each to the node that holds the unit.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...config import SiteConfig
from ...dispatch import Dispatcher
from ...transport import Peer
from .jobs import ReplicationJobs
from .peers import PeerFactory
from .read_model import Info, ReplicationStatus
from .requests import ReplicationRequests


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


class ReplicationAPI:
    def __init__(self, status: ReplicationStatus, requests: ReplicationRequests):
        self.status = status
        self.requests = requests

    def enable(self, kind: str, ident: str, params: dict) -> None:
        self.requests.enable(self.status.resolve(kind, ident), dict(params))

    def disable(self, kind: str, ident: str, params: dict) -> None:
        self.requests.disable(self.status.resolve(kind, ident), dict(params))

    def promote(self, kind: str, ident: str, force: bool, params: dict | None = None) -> None:
        self.requests.promote(self.status.resolve(kind, ident), force=force, params=dict(params or {}))

    def promote_all(self, force: bool, *, dry_run: bool = False, units: list | None = None,
                    wait: float = 0.0) -> list[dict]:
        """Every unit held here as secondary: listed (*dry_run*), or promoted in one batch."""
        if dry_run:
            return self.requests.secondaries()
        return self.requests.promote_all(force=force, units=units, wait=wait)

    def demote_all(self, *, resync: bool = False, dry_run: bool = False, units: list | None = None,
                   wait: float = 0.0) -> list[dict]:
        """Every unit held here as primary: listed (*dry_run*), or demoted in one batch (and
        resynced with force, with *resync*)."""
        if dry_run:
            return [{k: v for k, v in r.items() if k != "members"} for r in self.requests.primaries()]
        return self.requests.demote_all(resync=resync, units=units, wait=wait)

    def demote(self, kind: str, ident: str, force: bool) -> None:
        self.requests.demote(self.status.resolve(kind, ident), force=force)

    def resync(self, kind: str, ident: str, force: bool) -> bool:
        return self.requests.resync(self.status.resolve(kind, ident), force=force)

    def info(self, kind: str, ident: str) -> Info:
        return self.status.info(self.status.resolve(kind, ident))

    def sync_now(self, kind: str, ident: str, wait: float | None = None) -> dict:
        return self.requests.sync_now(self.status.resolve(kind, ident), wait=wait)
