"""Volume group snapshots on a site of several nodes: a group snapshot whose volumes sit on
several nodes is cut in parts, one ``group_snapshot_part`` task per node, all sent at
once; each node freezes its members and meets the others at a barrier before any clones."""
from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Sequence

from ..errors import DrsvcError, GroupSnapshotExists, GroupSnapshotNotFound, MissingField, SnapshotListMismatch
from ..ids import check_id, check_name, name_key
from ..model import Snapshot
from ..snapshots import GroupSnapshot
from .routing import Router
from .wire import gs_in

log = logging.getLogger(__name__)
Parts = list[tuple[GroupSnapshot, list[Snapshot]]]


def merge(gsid: str, parts: Parts) -> tuple[GroupSnapshot, list[Snapshot]]:
    """One group snapshot from its parts (node order); its freeze window spans them all."""
    first = parts[0][0]
    gs = GroupSnapshot(group_snapshot_id=gsid, name=first.name, parameters=first.parameters,
                       created_at=min(p.created_at for p, _ in parts), nodes=first.nodes,
                       state="ready" if all(p.state == "ready" for p, _ in parts) else "creating",
                       frozen_at=min(p.frozen_at for p, _ in parts),
                       cloned_at=max(p.cloned_at for p, _ in parts),
                       thawed_at=max(p.thawed_at for p, _ in parts))
    gs.freeze_seconds = max(0.0, gs.thawed_at - gs.frozen_at)
    members = []
    for p, m in parts:
        gs.source_volume_ids += p.source_volume_ids
        gs.snapshot_ids += p.snapshot_ids
        members += m
    return gs, members


def member_ids(gsid: str, by_node: dict[str, list]) -> dict[str, str]:
    """Each source volume's member snapshot id: on its node, the same for every attempt."""
    return {v: f"{n}.snap-{hashlib.sha256(f'{gsid}/{v}'.encode()).hexdigest()[:24]}"
            for n, vids in by_node.items() for v in vids}


class ClusterGroupSnapshots:
    BARRIER_TIMEOUT = 5.0     # the longest a node holds its freeze waiting for the others

    def __init__(self, router: Router):
        self.router = router
        self.calls = router.calls

    def create(self, name: str, source_volume_ids: Sequence[str], parameters: dict | None):
        check_name(name)
        if not source_volume_ids:
            raise MissingField(field="source_volume_ids")
        sources = list(dict.fromkeys(check_id(v, "source_volume_ids") for v in source_volume_ids))
        by_node = self.router.by_node(sources, "source_volume_ids")
        params = dict(parameters or {})
        if len(by_node) == 1:
            return gs_in(self.router.call(next(iter(by_node)), "create_group_snapshot", {
                "name": name, "source_volume_ids": sources, "parameters": params}))
        nodes = sorted(by_node)
        fresh = f"{nodes[0]}.gsnap-{secrets.token_hex(12)}"
        gsid = self.calls.claim(name_key("group-snapshot", name), fresh)
        if gsid != fresh:               # a retry, or the name is taken
            gs, members = self.get(gsid, ())
            if sorted(gs.source_volume_ids) != sorted(sources):
                raise GroupSnapshotExists(name=name, reason="source volumes")
            if gs.state == "ready":
                return gs, members
        return self._cut(gsid, name, by_node, params)

    def _cut(self, gsid: str, name: str, by_node: dict[str, list], params: dict):
        """Every node's part at once; nothing half-made stays when one fails."""
        nodes = sorted(by_node)
        sid = member_ids(gsid, by_node)
        barrier = f"{gsid}:{secrets.token_hex(4)}"      # a fresh meeting per attempt
        kwargs = {n: {"group_snapshot_id": gsid, "name": name, "source_volume_ids": vids,
                      "snapshot_ids": [sid[v] for v in vids], "parameters": params, "nodes": nodes,
                      "barrier": barrier, "timeout": self.BARRIER_TIMEOUT} for n, vids in by_node.items()}
        parts = self.calls.call_each(kwargs, "group_snapshot_part", wait=self.router.wait)
        failed = [r for r in parts.values() if isinstance(r, DrsvcError)]
        if failed:
            self._undo(gsid, name, nodes)
            raise failed[0]
        gs, members = merge(gsid, [gs_in(parts[n]) for n in nodes])
        log.info("group snapshot %s (%s) cut on %d nodes at one instant: the first node froze %.1f ms before "
                 "the last thawed", gsid, name, len(nodes), gs.freeze_seconds * 1e3)
        return gs, members

    def _undo(self, gsid: str, name: str, nodes: list[str]) -> None:
        """Remove the parts that were cut, and let the name go."""
        for n in nodes:
            try:
                self.router.call(n, "delete_group_snapshot", {"group_snapshot_id": gsid})
            except DrsvcError as e:
                log.warning("group snapshot %s: part on %s not removed: %s", gsid, n, e.message)
        self.calls.release(name_key("group-snapshot", name), gsid)

    def _parts(self, group_snapshot_id: str) -> Parts:
        home = self.router.holder_of(group_snapshot_id, "group_snapshot_id",
                                     GroupSnapshotNotFound(group_snapshot_id=group_snapshot_id))
        ask = {"group_snapshot_id": group_snapshot_id}
        first = gs_in(self.router.call(home, "get_group_snapshot", ask))
        others = [n for n in first[0].nodes if n != home]
        return [first] + [gs_in(self.router.call(n, "get_group_snapshot", ask)) for n in others]

    def get(self, group_snapshot_id: str, snapshot_ids: Sequence[str]):
        parts = self._parts(group_snapshot_id)
        if len(parts) == 1 and not parts[0][0].nodes:
            gs, members = parts[0]               # cut on one node: its own record says it all
        else:
            gs, members = merge(group_snapshot_id, parts)
        given = list(snapshot_ids)
        if given and sorted(set(given)) != sorted(gs.snapshot_ids):
            raise SnapshotListMismatch(group_snapshot_id=group_snapshot_id,
                                       reason=f"not members: {sorted(set(given) - set(gs.snapshot_ids))}; "
                                              f"members not named: {sorted(set(gs.snapshot_ids) - set(given))}")
        return gs, members

    def delete(self, group_snapshot_id: str, snapshot_ids: Sequence[str]) -> None:
        home = self.router.node_of(check_id(group_snapshot_id, "group_snapshot_id"))
        if home is None:
            return
        try:
            gs, _ = self.get(group_snapshot_id, snapshot_ids)
        except GroupSnapshotNotFound:
            return
        for n in (gs.nodes or [home])[::-1]:     # the home part last
            self.router.call(n, "delete_group_snapshot", {"group_snapshot_id": group_snapshot_id})
        self.calls.release(name_key("group-snapshot", gs.name), group_snapshot_id)
