"""Volume groups on a site of several nodes: a group has a home node (its id names it); a
group whose members sit on several nodes keeps one part per node (a record with the same
id, name and parameters, listing that node's members and every part's node)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..controller_api import GroupView
from ..errors import GroupNotFound
from ..groups import Group
from ..ids import check_id, check_name, name_key
from ..model import Page
from .names import NameClaims
from .routing import Router
from .wire import group_in

log = logging.getLogger(__name__)


def merged(parts: list[GroupView]) -> GroupView:
    """One group from its parts (node order): their members, in that order."""
    first = parts[0]
    if len(parts) == 1:
        return first
    g = Group.from_doc(first.group.to_doc())
    g.volume_ids = [v for p in parts for v in p.group.volume_ids]
    return GroupView(g, [v for p in parts for v in p.volumes])


class ClusterGroups:
    """*any_node* picks a home for a group made with no member (placement's choice)."""

    def __init__(self, router: Router, names: NameClaims, any_node: Callable[[], str]):
        self.router = router
        self.names = names
        self.any_node = any_node

    def _call(self, group_id: str, op: str, **kwargs):
        node = self.router.holder_of(group_id, "volume_group_id", GroupNotFound(group_id=group_id))
        return self.router.call(node, op, {"group_id": group_id, **kwargs})

    def set_parts(self, view: GroupView, by_node: dict[str, list], home: str) -> GroupView:
        """Write every node's part of a group spanning nodes (members, and the list of
        nodes); drop the parts of nodes that no longer hold a member."""
        g = view.group
        nodes = sorted(set(by_node) | {home})
        calls = {n: {"group_id": g.group_id, "name": g.name, "parameters": dict(g.parameters),
                     "volume_ids": by_node.get(n, []), "nodes": nodes if len(nodes) > 1 else []} for n in nodes}
        out = self.router.call_all(calls, "ensure_group_part")
        for n in sorted(set(g.nodes) - set(nodes)):
            self.router.call(n, "forget_group_part", {"group_id": g.group_id})
        return merged([group_in(out[n]) for n in nodes])

    def create(self, name: str, parameters: dict | None, volume_ids: Sequence[str]) -> GroupView:
        check_name(name)
        key = name_key("group", name)
        by_node = self.router.by_node(volume_ids)
        holder, made = self.names.claim(key, lambda: min(by_node) if by_node else self.any_node())
        view = group_in(self.names.make(key, holder, made, "create_group", {
            "name": name, "parameters": dict(parameters or {}), "volume_ids": by_node.get(holder, [])},
            "group.group_id"))
        if len(by_node) > 1 or (by_node and holder not in by_node):
            log.info("volume group %s (%s) spans nodes %s", view.group.group_id, name, sorted(by_node))
            view = self.set_parts(view, by_node, holder)
        return view

    def modify(self, group_id: str, volume_ids: Sequence[str], parameters: dict | None) -> GroupView:
        home = self.router.node_of(check_id(group_id, "volume_group_id"))
        by_node = self.router.by_node(volume_ids)
        if home is None:
            raise GroupNotFound(group_id=group_id)
        cur = group_in(self._call(group_id, "get_group")).group
        if cur.nodes or set(by_node) - {home}:
            if parameters:
                cur.parameters = {**cur.parameters, **dict(parameters)}
            return self.set_parts(GroupView(cur, []), by_node, home)
        return group_in(self._call(group_id, "modify_group", volume_ids=list(volume_ids),
                                   parameters=dict(parameters or {})))

    def delete(self, group_id: str) -> None:
        home = self.router.node_of(check_id(group_id, "volume_group_id"))
        if home is None:
            return                      # names no node of this site: nothing to delete
        try:
            cur = group_in(self._call(group_id, "get_group")).group
        except GroupNotFound:
            cur = None
        for n in sorted(set(cur.nodes if cur else ()) - {home}):     # the other parts first, the home last
            self.router.call(n, "delete_group", {"group_id": group_id})
        self.names.unmake(home, "delete_group", "group_id", group_id)

    def get(self, group_id: str) -> GroupView:
        home = self.router.holder_of(group_id, "volume_group_id", GroupNotFound(group_id=group_id))
        view = group_in(self._call(group_id, "get_group"))
        others = [n for n in view.group.nodes if n != home]
        return merged([view] + [group_in(self.router.call(n, "get_group", {"group_id": group_id}))
                                for n in others])

    def list(self, max_entries: int, token: str) -> Page:
        page = self.router.pages("list_groups", max_entries, token, {"home_only": True}, group_in)
        return Page([self.get(v.group.group_id) if len(v.group.nodes) > 1 else v for v in page.items],
                    page.next_token)
