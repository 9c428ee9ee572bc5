"""The Replication RPCs by (kind, id): what the CSI-Addons Replication servicer calls.

:class:`ReplicationAPI` answers them over this process's pool (a one-node site, or a
storage node running its site controller's call); drsvc.cluster.ClusterReplication
sends each to the node that holds the unit.
"""
from __future__ import annotations

from .requests import ReplicationRequests
from .status import Info, ReplicationStatus


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

    def demote(self, kind: str, ident: str, force: bool) -> None:
        self.requests.demote(self.status.resolve(kind, ident), force=force)

    def resync(self, kind: str, ident: str, force: bool) -> bool:
        return self.requests.resync(self.status.resolve(kind, ident), force=force)

    def info(self, kind: str, ident: str) -> Info:
        return self.status.info(self.status.resolve(kind, ident))

    def sync_now(self, kind: str, ident: str, wait: float | None = None) -> dict:
        return self.requests.sync_now(self.status.resolve(kind, ident), wait=wait)
