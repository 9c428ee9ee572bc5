"""The node side of a multi-node site: one call of the site's controller, run on this node's
pool with a :class:`drsvc.controller.PoolController` (a ``drsvc.node`` task).

The operations are the controller contract's (drsvc.controller_api.CONTROLLER_OPS, same
names and parameters, arguments and results in JSON: :mod:`drsvc.cluster.wire`) and the
node-only operations in :data:`NODE_ONLY_OPS`, which the controller uses to cut a group
snapshot, keep a group's parts and settle a spanning group's replication round.
``tests/unit/test_controller_contract.py`` holds the two lists to the ``op_*`` methods.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..controller import PoolController
from ..controller_api import CONTROLLER_OPS, REPLICATION_OPS, ReplicationControl
from ..errors import DrsvcError, ReplicationNotConfigured
from ..ids import check_id, name_key
from ..replication.receiver import round_state, settle_round
from ..replication.control import Info
from .wire import caps_in, group_out, gs_out, page_out, source_in, status_out

NODE_ONLY_OPS = frozenset({
    "group_snapshot_part",      # this node's part of a group snapshot cut across nodes
    "ensure_group_part",        # this node's part of a group spanning nodes
    "forget_group_part",
    "replication",              # a Replication RPC (ReplicationControl) on a unit of this node
    "promote_all",              # this node's part of a site failover: its secondaries, in one batch
    "demote_all",               # ... of a site's failback: its primaries, in one batch
    "round_state",              # a spanning group's part: its applied and prepared generation
    "settle_round",             # ... and the round left prepared, applied or dropped
})
NODE_OPS = frozenset(CONTROLLER_OPS) | NODE_ONLY_OPS


class NodeOps:
    """The node side: one call from the site's controller, on this node's pool."""

    def __init__(self, ctl: PoolController, replication: ReplicationControl | None = None, barrier=None):
        self.ctl = ctl
        self.volumes = ctl.site.volumes
        self.replication = replication      # drsvc.replication.control.api.ReplicationAPI, with peers
        self.barrier = barrier              # (key, parties, timeout) -> cluster.calls.Barrier, from the edge

    def run(self, op: str, kwargs: dict) -> Any:
        if op not in NODE_OPS:
            raise DrsvcError(f"unknown node operation {op!r}")
        return getattr(self, f"op_{op}")(**kwargs)

    # -- the contract's operations -------------------------------------------------
    def op_probe(self) -> None:
        self.ctl.probe()

    def op_create_volume(self, name: str, *, required_bytes: int = 0, limit_bytes: int = 0, capabilities=(),
                         parameters=None, source=None, requisite=(), preferred=(), mutable=None) -> dict:
        return self.ctl.create_volume(name, required_bytes=required_bytes, limit_bytes=limit_bytes,
                                      capabilities=caps_in(capabilities), parameters=parameters,
                                      source=source_in(source), requisite=requisite, preferred=preferred,
                                      mutable=mutable).to_doc()

    def op_delete_volume(self, volume_id: str) -> str:
        """Delete; the name key whose claim the controller may drop ('' if there was none)."""
        vol = self.volumes.find_volume(check_id(volume_id))
        self.ctl.delete_volume(volume_id)
        return name_key("volume", vol.name) if vol is not None else ""

    def op_validate(self, volume_id: str, capabilities=(), parameters=None) -> str:
        return self.ctl.validate(volume_id, caps_in(capabilities), parameters or {})

    def op_get_volume(self, volume_id: str) -> dict:
        return status_out(self.ctl.get_volume(volume_id))

    def op_list_volumes(self, max_entries: int = 0, token: str = "") -> dict:
        return page_out(self.ctl.list_volumes(max_entries, token), status_out)

    def op_capacity(self, topology=None, capabilities=(), parameters=None) -> list:
        c = self.ctl.capacity(topology, caps_in(capabilities), parameters or {})
        return [c.available, c.maximum, c.minimum]

    def op_expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int) -> int:
        return self.ctl.expand_volume(volume_id, required_bytes, limit_bytes)

    def op_modify_volume(self, volume_id: str, mutable: dict) -> None:
        self.ctl.modify_volume(volume_id, mutable)

    def op_create_snapshot(self, name: str, source_volume_id: str, parameters=None) -> dict:
        return self.ctl.create_snapshot(name, source_volume_id, parameters).to_doc()

    def op_delete_snapshot(self, snapshot_id: str) -> str:
        snap = self.volumes.find_snapshot(check_id(snapshot_id, "snapshot_id"))
        self.ctl.delete_snapshot(snapshot_id)
        return name_key("snapshot", snap.name) if snap is not None else ""

    def op_get_snapshot(self, snapshot_id: str) -> dict:
        return self.ctl.get_snapshot(snapshot_id).to_doc()

    def op_list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                          source_volume_id: str = "") -> dict:
        return page_out(self.ctl.list_snapshots(max_entries, token, snapshot_id, source_volume_id),
                        lambda s: s.to_doc())

    def op_create_group(self, name: str, parameters=None, volume_ids=()) -> dict:
        return group_out(self.ctl.create_group(name, parameters, volume_ids))

    def op_modify_group(self, group_id: str, volume_ids=(), parameters=None) -> dict:
        return group_out(self.ctl.modify_group(group_id, volume_ids, parameters))

    def op_delete_group(self, group_id: str) -> str:
        g = self.ctl.site.groups.find(check_id(group_id, "volume_group_id"))
        self.ctl.delete_group(group_id)
        return name_key("group", g.name) if g is not None else ""

    def op_get_group(self, group_id: str) -> dict:
        return group_out(self.ctl.get_group(group_id))

    def op_list_groups(self, max_entries: int = 0, token: str = "", home_only: bool = False) -> dict:
        """home_only: leave out the parts of spanning groups whose home is another node."""
        page = self.ctl.list_groups(max_entries, token)
        home = f"{self.ctl.site.node_id}."
        return {"items": [group_out(v) for v in page.items
                          if not (home_only and v.group.nodes and not v.group.group_id.startswith(home))],
                "next_token": page.next_token}

    def op_create_group_snapshot(self, name: str, source_volume_ids, parameters=None) -> dict:
        return gs_out(*self.ctl.create_group_snapshot(name, source_volume_ids, parameters))

    def op_get_group_snapshot(self, group_snapshot_id: str, snapshot_ids=()) -> dict:
        return gs_out(*self.ctl.get_group_snapshot(group_snapshot_id, snapshot_ids))

    def op_delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids=()) -> None:
        self.ctl.delete_group_snapshot(group_snapshot_id, snapshot_ids)

    # -- node-only operations ------------------------------------------------------
    def op_group_snapshot_part(self, group_snapshot_id: str, name: str, source_volume_ids, snapshot_ids,
                               parameters, nodes, barrier: str, timeout: float) -> dict:
        """This node's part of a group snapshot across nodes: freeze, meet every other node
        at the barrier, clone, thaw."""
        gss = self.ctl.group_snapshots
        gs = gss.create_part(group_snapshot_id, name, source_volume_ids, snapshot_ids, parameters, nodes,
                             self.barrier(barrier, len(nodes), timeout))
        return gs_out(gs, gss.members(gs))

    def op_ensure_group_part(self, group_id: str, name: str, parameters, volume_ids, nodes) -> dict:
        g = self.ctl.site.groups.ensure_part(group_id, name=name, parameters=parameters or {},
                                            volume_ids=volume_ids, nodes=nodes)
        return group_out(self.ctl.group_view(g))

    def op_forget_group_part(self, group_id: str) -> None:
        self.ctl.site.groups.forget_part(group_id)

    def op_replication(self, method: str, kind: str, ident: str, **kwargs) -> Any:
        """A Replication RPC on a unit of this node (drsvc.controller_api.ReplicationControl)."""
        if self.replication is None:
            raise ReplicationNotConfigured(site=self.ctl.site_name)
        if method not in REPLICATION_OPS:
            raise DrsvcError(f"unknown replication call {method!r}")
        out = getattr(self.replication, method)(kind, ident, **kwargs)
        return asdict(out) if isinstance(out, Info) else out

    def op_promote_all(self, force: bool = False, dry_run: bool = False, units: list | None = None,
                       wait: float = 0.0) -> list:
        """The units held here as secondary (*dry_run*), or those of *units*, promoted in one batch."""
        if self.replication is None:
            raise ReplicationNotConfigured(site=self.ctl.site_name)
        return self.replication.promote_all(bool(force), dry_run=bool(dry_run), units=units, wait=float(wait))

    def op_demote_all(self, resync: bool = False, dry_run: bool = False, units: list | None = None,
                      wait: float = 0.0) -> list:
        """The units held here as primary (*dry_run*), or those of *units*, demoted in one batch."""
        if self.replication is None:
            raise ReplicationNotConfigured(site=self.ctl.site_name)
        return self.replication.demote_all(resync=bool(resync), dry_run=bool(dry_run), units=units, wait=float(wait))

    def op_round_state(self, unit_id: str) -> dict:
        """A spanning group's part here: applied generation, and a round left prepared."""
        return round_state(self.ctl.site.pool.layout, check_id(unit_id, "volume_group_id"))

    def op_settle_round(self, unit_id: str, txid: str, commit: bool) -> dict:
        return settle_round(self.ctl.site.pool.layout, check_id(unit_id, "volume_group_id"),
                            check_id(txid, "transaction id"), bool(commit))
