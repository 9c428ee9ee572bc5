"""Wires one site's core services together over its pool."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import SiteConfig
from .errors import PreconditionFailed
from .replication import state as unit_state
from .groups import GroupService
from .node import NodeService
from .pool import Pool
from .volumes import VolumeService, pair_zone


@dataclass
class Site:
    pool: Pool
    volumes: VolumeService
    node: NodeService
    groups: GroupService
    node_id: str
    config: SiteConfig | None = None
    replication: object = None          # drsvc.replication.service.ReplicationService, when configured

    @classmethod
    def open(cls, pool_dir: Path, *, node_id: str, site_id: str = "local",
             config: SiteConfig | None = None) -> Site:
        pool = Pool(pool_dir, site=site_id).init()
        volumes = VolumeService(pool, node_id, zone=pair_zone(site_id, config.peers, config.zone)
                                if config is not None else None)
        node = NodeService(pool, volumes, node_id)
        site = cls(pool, volumes, node, None, node_id, config)
        site.groups = GroupService(pool, volumes, in_use=node.in_use, replicated=site.is_replicated,
                                   replica_of=site.is_secondary)
        node.publish_policy = site.check_writable
        return site

    def check_writable(self, volume_id: str, readonly: bool) -> None:
        """A replication secondary may be used read-only, never read-write."""
        if readonly:
            return
        vol = self.volumes.find_volume(volume_id)
        unit = (vol.group_id if vol and vol.group_id else volume_id)
        st = unit_state.find_state(self.pool.root, unit)
        if st is not None and st.role == "secondary":
            raise PreconditionFailed(f"volume {volume_id} is a replication secondary on site {self.pool.site}: "
                                     "it can be published read-only only; promote it to write")

    @classmethod
    def from_config(cls, cfg: SiteConfig) -> Site:
        return cls.open(cfg.pool, node_id=cfg.node_id, site_id=cfg.site, config=cfg)

    def is_secondary(self, unit_id: str) -> bool:
        st = unit_state.find_state(self.pool.root, unit_id)
        return st is not None and st.role == "secondary"

    def is_replicated(self, unit_id: str) -> bool:
        return self.replication is not None and self.replication.is_enabled(unit_id)

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
