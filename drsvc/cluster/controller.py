"""ClusterController: the controller contract (drsvc.controller_api.Controller) on a site of
several storage nodes. It holds no pool: it places volumes (:mod:`.placement`), claims
names (:mod:`.names`) and sends every call that touches a pool to the node its id names
(:mod:`.routing`); volume groups and group snapshots spanning nodes are kept in parts
(:mod:`.groups`, :mod:`.group_snapshots`)."""
from __future__ import annotations

from collections.abc import Sequence

from ..config import SiteConfig
from ..controller_api import Capacity, GroupView, VolumeStatus
from ..errors import DrsvcError, GroupNotFound, GroupSpansNodes, NodeUnreachable, SnapshotExists, \
    SnapshotNotFound, VolumeNotFound
from ..ids import check_id, check_map, check_name, name_key
from ..model import Capability, ContentSource, Page, Snapshot, Volume
from ..modify import check_mutable
from ..snapshots import GroupSnapshot
from ..volumes import DEFAULT_CAPACITY, check_capabilities
from .calls import NodeCalls
from .group_snapshots import ClusterGroupSnapshots
from .groups import ClusterGroups
from .names import NameClaims
from .placement import Placement
from .routing import Router
from .wire import caps_out, source_out, status_in


def default_size(required_bytes: int, limit_bytes: int) -> int:
    """The size a new volume is placed for (a volume made with no size gets the default)."""
    return required_bytes or (min(DEFAULT_CAPACITY, limit_bytes) if limit_bytes else DEFAULT_CAPACITY)


class ClusterController:
    """The CSI controller calls of a multi-node site, each sent to the node it concerns."""

    def __init__(self, cfg: SiteConfig, calls: NodeCalls, *, wait: float | None = None, probe_wait: float = 2.0):
        self.cfg = cfg
        self.router = Router(cfg, calls, wait or cfg.node_call_timeout)    # one node call
        self.placement = Placement(cfg, calls, probe_wait)
        self.names = NameClaims(self.router)
        self.groups = ClusterGroups(self.router, self.names, lambda: self.placement.place(0, (), [], []))
        self.group_snapshots = ClusterGroupSnapshots(self.router)

    @property
    def site_name(self) -> str:
        return self.cfg.site

    def node_of(self, object_id: str) -> str | None:
        """The node an id names (None: not an id of this site's nodes)."""
        return self.router.node_of(object_id)

    def probe(self) -> None:
        """Ready when at least one storage node answers."""
        wait = self.placement.probe_wait
        results = self.router.calls.call_each(dict.fromkeys(self.cfg.nodes, {}), "probe", wait=wait)
        if all(isinstance(r, DrsvcError) for r in results.values()):
            raise NodeUnreachable(node="(all)", site=self.cfg.site, wait=wait, reason="no storage node answered")

    # -- volumes -------------------------------------------------------------------
    def create_volume(self, name: str, *, required_bytes: int = 0, limit_bytes: int = 0,
                      capabilities: Sequence[Capability] = (), parameters: dict | None = None,
                      source: ContentSource | None = None, requisite: Sequence[dict] = (),
                      preferred: Sequence[dict] = (), mutable: dict | None = None) -> Volume:
        check_name(name)
        check_capabilities(list(capabilities))    # before placement, which would call them "no room"
        mutable = check_mutable(dict(mutable or {}))
        parameters = dict(check_map(parameters or {}, "parameters"))
        kwargs = {"name": name, "required_bytes": required_bytes, "limit_bytes": limit_bytes,
                  "capabilities": caps_out(capabilities), "parameters": parameters,
                  "source": source_out(source), "requisite": list(requisite), "mutable": mutable}

        def choose() -> str:
            if group := parameters.get("volumeGroup", ""):
                return self._group_node(group, source)
            if source is not None:
                return self._source_node(source)
            return self.placement.place(default_size(required_bytes, limit_bytes), capabilities,
                                        list(requisite), list(preferred))
        key = name_key("volume", name)
        holder, made = self.names.claim(key, choose)
        return Volume.from_doc(self.names.make(key, holder, made, "create_volume", kwargs, "volume_id"))

    def _group_node(self, group_id: str, source: ContentSource | None) -> str:
        """A group member is made on its group's node (a clone's source must be there too)."""
        node = self.router.holder_of(group_id, "volumeGroup", GroupNotFound(group_id=group_id))
        if source is not None and self._source_node(source) != node:
            raise GroupSpansNodes(reason=f"the source {source.source_id} is not on group {group_id}'s node {node}")
        return node

    def _source_node(self, source: ContentSource) -> str:
        """A clone is made by reflink, on the node that holds its source."""
        missing = SnapshotNotFound(snapshot_id=source.source_id) if source.kind == "snapshot" \
            else VolumeNotFound(volume_id=source.source_id)
        return self.router.holder_of(source.source_id, "source id", missing)

    def delete_volume(self, volume_id: str) -> None:
        node = self.router.node_of(check_id(volume_id))
        if node is None:
            return          # not a volume of this site's nodes: nothing to delete
        self.names.unmake(node, "delete_volume", "volume_id", volume_id)

    def validate(self, volume_id: str, capabilities: Sequence[Capability], parameters: dict) -> str:
        return self.router.on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "validate",
                              capabilities=caps_out(capabilities), parameters=dict(parameters))

    def get_volume(self, volume_id: str) -> VolumeStatus:
        return status_in(self.router.on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "get_volume"))

    def list_volumes(self, max_entries: int = 0, token: str = "") -> Page:
        return self.router.pages("list_volumes", max_entries, token, {}, status_in)

    def capacity(self, topology: dict | None = None, capabilities: Sequence[Capability] = (),
                 parameters: dict | None = None) -> Capacity:
        return self.placement.total(topology, capabilities, parameters)

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int) -> int:
        return self.router.on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "expand_volume",
                              required_bytes=required_bytes, limit_bytes=limit_bytes)

    def modify_volume(self, volume_id: str, mutable: dict) -> None:
        self.router.on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "modify_volume",
                       mutable=check_mutable(dict(mutable)))

    # -- snapshots -----------------------------------------------------------------
    def create_snapshot(self, name: str, source_volume_id: str, parameters: dict | None = None) -> Snapshot:
        check_name(name)
        node = self.router.holder_of(source_volume_id, "source_volume_id", VolumeNotFound(volume_id=source_volume_id))
        key = name_key("snapshot", name)
        holder, made = self.names.claim(key, lambda: node)
        if holder != node:
            raise SnapshotExists(name=name)       # that name is a snapshot on another node
        return Snapshot.from_doc(self.names.make(key, node, made, "create_snapshot", {
            "name": name, "source_volume_id": source_volume_id, "parameters": dict(parameters or {})},
            "snapshot_id"))

    def delete_snapshot(self, snapshot_id: str) -> None:
        node = self.router.node_of(check_id(snapshot_id, "snapshot_id"))
        if node is None:
            return
        self.names.unmake(node, "delete_snapshot", "snapshot_id", snapshot_id)

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return Snapshot.from_doc(self.router.on(snapshot_id, "snapshot_id", SnapshotNotFound(snapshot_id=snapshot_id),
                                                "get_snapshot"))

    def list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                       source_volume_id: str = "") -> Page:
        one = snapshot_id or source_volume_id
        if not one:
            return self.router.pages("list_snapshots", max_entries, token, {}, Snapshot.from_doc)
        node = self.router.node_of(one)
        if node is None:
            return Page([], "")
        page = self.router.call(node, "list_snapshots", {"max_entries": max_entries, "token": token,
                                                         "snapshot_id": snapshot_id,
                                                         "source_volume_id": source_volume_id})
        return Page([Snapshot.from_doc(d) for d in page["items"]], page["next_token"])

    # -- volume groups: on one node, or in parts on several (one record per node) -----------
    def create_group(self, name: str, parameters: dict | None = None, volume_ids: Sequence[str] = ()) -> GroupView:
        return self.groups.create(name, parameters, volume_ids)

    def modify_group(self, group_id: str, volume_ids: Sequence[str], parameters: dict | None = None) -> GroupView:
        return self.groups.modify(group_id, volume_ids, parameters)

    def delete_group(self, group_id: str) -> None:
        self.groups.delete(group_id)

    def get_group(self, group_id: str) -> GroupView:
        return self.groups.get(group_id)

    def list_groups(self, max_entries: int = 0, token: str = "") -> Page:
        return self.groups.list(max_entries, token)

    # -- volume group snapshots: across nodes, cut in parts at one instant ----------------
    def create_group_snapshot(self, name: str, source_volume_ids: Sequence[str],
                              parameters: dict | None = None) -> tuple[GroupSnapshot, list[Snapshot]]:
        return self.group_snapshots.create(name, source_volume_ids, parameters)

    def get_group_snapshot(self, group_snapshot_id: str,
                           snapshot_ids: Sequence[str] = ()) -> tuple[GroupSnapshot, list[Snapshot]]:
        return self.group_snapshots.get(group_snapshot_id, snapshot_ids)

    def delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids: Sequence[str] = ()) -> None:
        self.group_snapshots.delete(group_snapshot_id, snapshot_ids)
