"""The controller contract: what csi_plugin's controller-side servicers call, typed once.

Two implementations answer it. :class:`drsvc.controller.PoolController` runs the calls on
the pool of this process's site (a one-node site, or a storage node running a task sent by
its site's controller); :class:`drsvc.cluster.ClusterController` runs them on a site of
several storage nodes, placing volumes and sending each call to the node holding the
object, where :class:`drsvc.cluster.NodeOps` runs it with a PoolController. The
servicers (``csi_plugin.csi_servicers``, ``group_servicer``, ``addons_servicers``) are
typed against :class:`Controller` and :class:`ReplicationControl`, as csi-driver-host-path
types its driver against one ``State`` interface (``pkg/state/state.go``).

Python has no ``var _ State = &state{}``: ``tests/unit/test_controller_contract.py`` checks
that every member exists on each implementation with the same parameters, defaults and
types, and that every node operation is a contract operation or a named node-only one.

Results are model objects, never protobufs.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .groups import Group
from .model import Capability, ContentSource, Page, Snapshot, Volume
from .replication.control import Info
from .snapshots import GroupSnapshot


@dataclass
class VolumeStatus:
    """A volume with what ControllerGetVolume and ListVolumes report about it."""
    volume: Volume
    published_node_ids: list = field(default_factory=list)
    problem: str = ""                 # empty: healthy


@dataclass
class GroupView:
    """A volume group with its member volumes, as the VolumeGroup RPCs answer it."""
    group: Group
    volumes: list = field(default_factory=list)


@dataclass(frozen=True)
class Capacity:
    available: int
    maximum: int
    minimum: int


class Controller(Protocol):
    """CSI Controller and GroupController, and CSI-Addons VolumeGroup, over model objects."""

    @property
    def site_name(self) -> str: ...

    def probe(self) -> None:
        """Return when the pool (or a storage node) is reachable; raise otherwise."""

    # -- volumes -------------------------------------------------------------------
    def create_volume(self, name: str, *, required_bytes: int = 0, limit_bytes: int = 0,
                      capabilities: Sequence[Capability] = (), parameters: dict | None = None,
                      source: ContentSource | None = None, requisite: Sequence[dict] = (),
                      preferred: Sequence[dict] = (), mutable: dict | None = None) -> Volume: ...

    def delete_volume(self, volume_id: str) -> None: ...

    def validate(self, volume_id: str, capabilities: Sequence[Capability], parameters: dict) -> str:
        """Why the volume cannot be used with these capabilities ('' when it can)."""

    def get_volume(self, volume_id: str) -> VolumeStatus: ...

    def list_volumes(self, max_entries: int = 0, token: str = "") -> Page:
        """A page of VolumeStatus."""

    def capacity(self, topology: dict | None = None, capabilities: Sequence[Capability] = (),
                 parameters: dict | None = None) -> Capacity: ...

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int) -> int:
        """The volume's new size in bytes."""

    def modify_volume(self, volume_id: str, mutable: dict) -> None: ...

    # -- snapshots -----------------------------------------------------------------
    def create_snapshot(self, name: str, source_volume_id: str, parameters: dict | None = None) -> Snapshot: ...

    def delete_snapshot(self, snapshot_id: str) -> None: ...

    def get_snapshot(self, snapshot_id: str) -> Snapshot: ...

    def list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                       source_volume_id: str = "") -> Page:
        """A page of Snapshot."""

    # -- volume groups (CSI-Addons VolumeGroup) --------------------------------------
    def create_group(self, name: str, parameters: dict | None = None, volume_ids: Sequence[str] = ()) -> GroupView: ...

    def modify_group(self, group_id: str, volume_ids: Sequence[str], parameters: dict | None = None) -> GroupView: ...

    def delete_group(self, group_id: str) -> None: ...

    def get_group(self, group_id: str) -> GroupView: ...

    def list_groups(self, max_entries: int = 0, token: str = "") -> Page:
        """A page of GroupView."""

    # -- volume group snapshots (CSI GroupController) ----------------------------------
    def create_group_snapshot(self, name: str, source_volume_ids: Sequence[str],
                              parameters: dict | None = None) -> tuple[GroupSnapshot, list[Snapshot]]:
        """(group snapshot, its member snapshots)."""

    def get_group_snapshot(self, group_snapshot_id: str,
                           snapshot_ids: Sequence[str] = ()) -> tuple[GroupSnapshot, list[Snapshot]]: ...

    def delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids: Sequence[str] = ()) -> None: ...


class ReplicationControl(Protocol):
    """The CSI-Addons Replication RPCs by (kind, id), kind "volume" or "group":
    drsvc.replication.control.api.ReplicationAPI over a pool, drsvc.cluster.ClusterReplication
    across the nodes of a site."""

    def enable(self, kind: str, ident: str, params: dict) -> None: ...

    def disable(self, kind: str, ident: str, params: dict) -> None: ...

    def promote(self, kind: str, ident: str, force: bool, params: dict | None = None) -> None:
        """*params*: the class's; ``drsvc.io/recoveryPoint`` takes over at that recovery point."""

    def demote(self, kind: str, ident: str, force: bool) -> None: ...

    def resync(self, kind: str, ident: str, force: bool) -> bool:
        """Whether the unit is ready (resynced)."""

    def info(self, kind: str, ident: str) -> Info: ...

    def sync_now(self, kind: str, ident: str, wait: float | None = None) -> dict: ...


def operations(protocol: type) -> tuple[str, ...]:
    """The names of a contract's operations (its methods; properties are not operations)."""
    return tuple(name for name, member in vars(protocol).items()
                 if not name.startswith("_") and inspect.isfunction(member))


CONTROLLER_OPS = operations(Controller)
REPLICATION_OPS = operations(ReplicationControl)
