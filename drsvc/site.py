"""Wires one site's core services together over its pool."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .node import NodeService
from .pool import Pool
from .volumes import VolumeService


@dataclass
class Site:
    pool: Pool
    volumes: VolumeService
    node: NodeService
    node_id: str

    @classmethod
    def open(cls, pool_dir: Path, *, node_id: str, site_id: str = "local") -> "Site":
        pool = Pool(pool_dir, site=site_id).init()
        volumes = VolumeService(pool, node_id)
        node = NodeService(pool, volumes, node_id)
        return cls(pool, volumes, node, node_id)

    def delete_volume(self, volume_id: str) -> None:
        self.volumes.delete_volume(volume_id, in_use=self.node.in_use)

    def create_snapshot(self, name: str, source_volume_id: str, parameters: dict | None = None):
        return self.volumes.create_snapshot(name, source_volume_id, parameters=parameters,
                                            freeze=self.node.consistent)
