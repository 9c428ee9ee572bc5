"""Wires one site's core services together over its pool, in one factory."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from .config import SiteConfig
from .dispatch import Dispatcher
from .errors import NotPrimary
from .groups import GroupService
from .node import NodeService
from .pool import Pool
from .replication.common import find_state
from .replication.control import Replication, ReplicationStatus, build, is_enabled
from .volumes import VolumeService, pair_zone


def check_writable(pool: Pool, volumes: VolumeService, volume_id: str, readonly: bool) -> None:
    """A replication secondary may be used read-only, never read-write."""
    if readonly:
        return
    vol = volumes.find_volume(volume_id)
    unit = (vol.group_id if vol and vol.group_id else volume_id)
    st = find_state(pool.root, unit)
    if st is not None and st.role == "secondary":
        raise NotPrimary(f"volume {volume_id} is a replication secondary on site {pool.site}: "
                         "it can be published read-only only; promote it to write", unit_id=unit, role=st.role)


def is_secondary(pool_root, unit_id: str) -> bool:
    """The unit replicates into this site (a group's members then follow the primary's)."""
    st = find_state(pool_root, unit_id)
    return st is not None and st.role == "secondary"


@dataclass(frozen=True)
class Site:
    pool: Pool
    volumes: VolumeService
    node: NodeService
    groups: GroupService
    node_id: str
    status: ReplicationStatus                 # the replication read model (no dispatcher needed)
    config: SiteConfig | None = None
    replication: Replication | None = None    # requests and jobs, when a config and a dispatcher are given

    @classmethod
    def open(cls, pool_dir: Path, *, node_id: str, site_id: str = "local", config: SiteConfig | None = None,
             dispatcher: Dispatcher | None = None, connect=None, rpc_wait: float = 20.0) -> Site:
        pool = Pool(pool_dir, site=site_id).init()
        node_cfg = config.nodes.get(node_id) if config is not None else None
        volumes = VolumeService(pool, node_id, zone=pair_zone(site_id, config.peers, config.zone)
                                if config is not None else None,
                                node_labels=node_cfg.labels if node_cfg is not None else None,
                                node_pair=node_cfg.pair if node_cfg is not None else "")
        node = NodeService(pool, volumes, node_id, publish_policy=functools.partial(check_writable, pool, volumes))
        groups = GroupService(pool, volumes, in_use=node.in_use,
                              replicated=functools.partial(is_enabled, pool.root),
                              replica_of=functools.partial(is_secondary, pool.root))
        status = ReplicationStatus(site_id, pool.root, volumes, groups,
                                   verify_interval=config.verify_interval if config is not None else 0)
        replication = None
        if config is not None and dispatcher is not None:
            replication = build(config, status, dispatcher, volumes=volumes, groups=groups, node=node,
                                connect=connect, rpc_wait=rpc_wait)
        return cls(pool, volumes, node, groups, node_id, status, config, replication)

    @classmethod
    def from_config(cls, cfg: SiteConfig, *, dispatcher: Dispatcher | None = None, **kw) -> Site:
        return cls.open(cfg.pool, node_id=cfg.node_id, site_id=cfg.site, config=cfg, dispatcher=dispatcher, **kw)

    def is_replicated(self, unit_id: str) -> bool:
        return self.status.is_enabled(unit_id)

    def check_secrets(self, secrets: dict) -> None:
        if self.config is not None:
            self.config.check_secrets(secrets)

    def in_use(self, volume_id: str) -> str:
        if reason := self.node.in_use(volume_id):
            return reason
        if self.is_replicated(volume_id):
            return "replication is enabled; disable it first"
        return ""

    def create_volume(self, name: str, **kw):
        if group_id := (kw.get("parameters") or {}).get("volumeGroup"):
            self.groups.get(group_id)          # fail before creating anything
        vol = self.volumes.create_volume(name, **kw)
        group = vol.parameters.get("volumeGroup")
        if group and vol.group_id != group:
            self.groups.join(group, vol.volume_id)
            vol = self.volumes.get_volume(vol.volume_id)
        return vol

    def delete_volume(self, volume_id: str) -> None:
        self.volumes.delete_volume(volume_id, in_use=self.in_use)

    def delete_group(self, group_id: str) -> None:
        self.groups.delete(group_id, self.delete_volume)

    def create_snapshot(self, name: str, source_volume_id: str, parameters: dict | None = None):
        return self.volumes.create_snapshot(name, source_volume_id, parameters=parameters,
                                            freeze=self.node.consistent)
