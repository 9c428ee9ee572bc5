"""The controller contract (drsvc.controller_api.Controller) over one pool.

:class:`PoolController` runs the CSI controller calls on the pool of this process's site:
a one-node site's plugin, or a storage node running a task sent by its site's controller
(drsvc.cluster.NodeOps). :class:`drsvc.cluster.ClusterController` answers the same
contract on a site of several storage nodes. Both return model objects, never protobufs.
"""
from __future__ import annotations

from collections.abc import Sequence

from . import snapshots
from .controller_api import Capacity, GroupView, VolumeStatus
from .groups import Group
from .model import Capability, ContentSource, Page, Snapshot, Volume
from .modify import VolumeModifier, check_mutable
from .site import Site
from .snapshots import GroupSnapshot, GroupSnapshotService


class PoolController:
    """drsvc.controller_api.Controller on one site's pool (drsvc.site.Site)."""

    def __init__(self, site: Site):
        self.site = site
        self.group_snapshots = GroupSnapshotService(site.pool, site.volumes, site.node)

    @property
    def site_name(self) -> str:
        return self.site.pool.site

    def probe(self) -> None:
        self.site.pool.space()            # the pool must be reachable

    def create_volume(self, name: str, *, required_bytes: int = 0, limit_bytes: int = 0,
                      capabilities: Sequence[Capability] = (), parameters: dict | None = None,
                      source: ContentSource | None = None, requisite: Sequence[dict] = (),
                      preferred: Sequence[dict] = (), mutable: dict | None = None) -> Volume:
        mutable = check_mutable(dict(mutable or {}))      # refused before anything is created
        vol = self.site.create_volume(name, required_bytes=required_bytes, limit_bytes=limit_bytes,
                                      capabilities=list(capabilities), parameters=parameters,
                                      source=source, requisite=list(requisite), preferred=list(preferred))
        if mutable:
            vol = VolumeModifier(self.site.volumes).modify(vol.volume_id, mutable)
        return vol

    def delete_volume(self, volume_id: str) -> None:
        self.site.delete_volume(volume_id)

    def validate(self, volume_id: str, capabilities: Sequence[Capability], parameters: dict) -> str:
        """Why the volume cannot be used with these capabilities ('' when it can)."""
        vol = self.site.volumes.get_volume(volume_id)
        return self.site.volumes.unsupported_reason(vol, list(capabilities), dict(parameters))

    def _status(self, vol: Volume) -> VolumeStatus:
        st = self.site.node.find_state(vol.volume_id)
        return VolumeStatus(vol, [self.site.node_id] if st and st.targets else [],
                            self.site.volumes.condition(vol.volume_id) or "")

    def get_volume(self, volume_id: str) -> VolumeStatus:
        return self._status(self.site.volumes.get_volume(volume_id))

    def list_volumes(self, max_entries: int = 0, token: str = "") -> Page:
        page = self.site.volumes.list_volumes(max_entries, token)
        return Page([self._status(v) for v in page.items], page.next_token)

    def capacity(self, topology: dict | None = None, capabilities: Sequence[Capability] = (),
                 parameters: dict | None = None) -> Capacity:
        return Capacity(*self.site.volumes.capacity(topology, list(capabilities), dict(parameters or {})))

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int) -> int:
        return self.site.volumes.expand_volume(volume_id, required_bytes, limit_bytes)

    def modify_volume(self, volume_id: str, mutable: dict) -> None:
        VolumeModifier(self.site.volumes).modify(volume_id, dict(mutable))

    def create_snapshot(self, name: str, source_volume_id: str, parameters: dict | None = None) -> Snapshot:
        return self.site.create_snapshot(name, source_volume_id, dict(parameters or {}))

    def delete_snapshot(self, snapshot_id: str) -> None:
        snapshots.delete_snapshot(self.site.volumes, snapshot_id)

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return snapshots.find_snapshot_any_state(self.site.volumes, snapshot_id)

    def list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                       source_volume_id: str = "") -> Page:
        return self.site.volumes.list_snapshots(max_entries, token, snapshot_id, source_volume_id)

    # -- volume groups (CSI-Addons VolumeGroup) ---------------------------------------
    def group_view(self, g: Group) -> GroupView:
        """*g* with its member volumes (those still recorded)."""
        return GroupView(g, [v for vid in g.volume_ids if (v := self.site.volumes.find_volume(vid)) is not None])

    def create_group(self, name: str, parameters: dict | None = None, volume_ids: Sequence[str] = ()) -> GroupView:
        return self.group_view(self.site.groups.create(name, dict(parameters or {}), list(volume_ids)))

    def modify_group(self, group_id: str, volume_ids: Sequence[str], parameters: dict | None = None) -> GroupView:
        return self.group_view(self.site.groups.modify(group_id, list(volume_ids), dict(parameters or {})))

    def delete_group(self, group_id: str) -> None:
        self.site.delete_group(group_id)

    def get_group(self, group_id: str) -> GroupView:
        return self.group_view(self.site.groups.get(group_id))

    def list_groups(self, max_entries: int = 0, token: str = "") -> Page:
        page = self.site.groups.list(max_entries, token)
        return Page([self.group_view(g) for g in page.items], page.next_token)

    # -- volume group snapshots (CSI GroupController) -----------------------------------
    def create_group_snapshot(self, name: str, source_volume_ids: Sequence[str],
                              parameters: dict | None = None) -> tuple[GroupSnapshot, list[Snapshot]]:
        """(group snapshot, its member snapshots)."""
        gs = self.group_snapshots.create(name, list(source_volume_ids), dict(parameters or {}))
        return gs, self.group_snapshots.members(gs)

    def get_group_snapshot(self, group_snapshot_id: str,
                           snapshot_ids: Sequence[str] = ()) -> tuple[GroupSnapshot, list[Snapshot]]:
        return self.group_snapshots.get(group_snapshot_id, list(snapshot_ids))

    def delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids: Sequence[str] = ()) -> None:
        self.group_snapshots.delete(group_snapshot_id, list(snapshot_ids))
