"""Routing: every id a node hands out starts with the node's name (``n1.vol-…``), so a call
on an object goes to the node its id names, with no table to keep."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..config import SiteConfig
from ..errors import BadPageToken, DrsvcError, VolumeNotFound
from ..ids import check_id
from ..model import Page
from .calls import NodeCalls


class Router:
    """The site's nodes, and the calls sent to them (each bounded by *wait* seconds)."""

    def __init__(self, cfg: SiteConfig, calls: NodeCalls, wait: float):
        self.cfg = cfg
        self.calls = calls
        self.wait = wait
        self.nodes = sorted(cfg.nodes)
        # node names may hold dots (FQDNs): an id "<node>.<local id>" names the longest that fits
        self._longest_first = sorted(cfg.nodes, key=len, reverse=True)

    def node_of(self, object_id: str) -> str | None:
        """The node an id names (None: not an id of this site's nodes)."""
        for node in self._longest_first:
            if object_id.startswith(node) and object_id[len(node):len(node) + 1] == ".":
                return node
        return None

    def holder_of(self, object_id: str, what: str, missing: DrsvcError) -> str:
        """The node holding *object_id* (the *what* field of a request); *missing* when its
        id names no node of this site."""
        node = self.node_of(check_id(object_id, what))
        if node is None:
            raise missing
        return node

    def call(self, node: str, op: str, kwargs: dict, *, wait: float | None = None) -> Any:
        return self.calls.call(node, op, kwargs, wait=self.wait if wait is None else wait)

    def on(self, object_id: str, what: str, missing: DrsvcError, op: str, **kwargs) -> Any:
        """*op* on the node holding *object_id*, which is sent as the *what* argument."""
        return self.call(self.holder_of(object_id, what, missing), op, {what: object_id, **kwargs})

    def call_all(self, calls: dict[str, dict], op: str, *, wait: float | None = None) -> dict:
        """*op* on every node of *calls* at once ({node: kwargs}): node -> result; the first
        node's error (in *calls*' order) when any failed."""
        out = self.calls.call_each(calls, op, wait=self.wait if wait is None else wait)
        failed = [out[n] for n in calls if isinstance(out[n], DrsvcError)]
        if failed:
            raise failed[0]
        return out

    def by_node(self, volume_ids: Iterable[str], what: str = "volume_id") -> dict[str, list]:
        """Volume ids by the node holding them, in the given order."""
        nodes: dict[str, list] = {}
        for vid in volume_ids:
            nodes.setdefault(self.holder_of(vid, what, VolumeNotFound(volume_id=vid)), []).append(vid)
        return nodes

    def pages(self, op: str, max_entries: int, token: str, kwargs: dict, decode: Callable[[dict], Any]) -> Page:
        """A page across the nodes, in node order: the token is '<node>:<that node's token>'."""
        start, inner = self.nodes[0], ""
        if token:
            start, colon, inner = token.partition(":")
            if not colon or start not in self.cfg.nodes:
                raise BadPageToken(token=token[:64])
        items: list = []
        later = self.nodes[self.nodes.index(start):]
        while later:
            node, later = later[0], later[1:]
            want = max_entries - len(items) if max_entries else 0
            page = self.call(node, op, {"max_entries": want, "token": inner, **kwargs})
            items += [decode(d) for d in page["items"]]
            inner = ""
            if page["next_token"]:
                return Page(items, f"{node}:{page['next_token']}")
            if max_entries and len(items) >= max_entries:
                return Page(items, f"{later[0]}:" if later else "")
        return Page(items, "")
