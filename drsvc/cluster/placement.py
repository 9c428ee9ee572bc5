"""Placement: which node of the site gets a new volume, from the nodes' topologies and the
capacity each reports when asked."""
from __future__ import annotations

import logging
import time

from ..config import SiteConfig
from ..controller_api import Capacity
from ..errors import CapacityOutOfRange, DrsvcError, NodeUnreachable, NoNodeFits
from ..volumes import node_topology, pair_zone
from .calls import NodeCalls
from .wire import caps_out

log = logging.getLogger(__name__)


def matches(topology: dict, term: dict) -> bool:
    return all(topology.get(k) == v for k, v in term.items())


class Placement:
    SUSPECT_FOR = 30.0    # a node that did not answer is left out of placement this long

    def __init__(self, cfg: SiteConfig, calls: NodeCalls, probe_wait: float):
        self.site = cfg.site
        self.calls = calls
        self.probe_wait = probe_wait                # capacity asked of every node while placing
        self._suspect: dict[str, float] = {}        # node -> monotonic time it is asked again
        zone = pair_zone(cfg.site, cfg.peers, cfg.zone)
        self.topologies = {n: node_topology(zone, c.pair, c.labels) for n, c in sorted(cfg.nodes.items())}

    def capacities(self, nodes: list[str], capabilities) -> dict[str, list]:
        """[free, maximum, minimum] bytes of each node that answers in time, asked now (a
        cached answer would hide a node that just died, and pin a name's claim to it). A
        node that did not answer is left out, and not asked again for SUSPECT_FOR seconds,
        so a dead node does not slow every placement down; when it is the only candidate it
        is asked all the same."""
        now = time.monotonic()
        ask = [n for n in nodes if self._suspect.get(n, 0) <= now] or nodes
        out = {}
        kwargs = {"capabilities": caps_out(capabilities)}
        for node, r in self.calls.call_each(dict.fromkeys(ask, kwargs), "capacity", wait=self.probe_wait).items():
            if isinstance(r, DrsvcError):
                log.warning("node %s left out of placement for %.0fs: %s", node, self.SUSPECT_FOR, r.message)
                self._suspect[node] = time.monotonic() + self.SUSPECT_FOR
            else:
                self._suspect.pop(node, None)
                out[node] = list(r)
        return out

    def place(self, size: int, capabilities, requisite: list[dict], preferred: list[dict]) -> str:
        """The node for a new volume: the first preferred topology that has room, then any
        node of the requisite topologies (all nodes when none is given), most free space first."""
        eligible = [n for n, t in self.topologies.items()
                    if not requisite or any(matches(t, term) for term in requisite)]
        if not eligible:
            raise NoNodeFits(site=self.site, reason=f"no node is in the requisite topology {requisite}")
        caps = self.capacities(eligible, capabilities)
        if not caps:
            raise NodeUnreachable(node=", ".join(eligible), site=self.site, wait=self.probe_wait,
                                  reason="no eligible node answered")
        if all(size > c[1] for c in caps.values()):
            # larger than any eligible node's whole pool: no placement ever fits, the range is
            # what is wrong (OUT_OF_RANGE, as a one-node site's plugin answers)
            raise CapacityOutOfRange(reason=f"{size} bytes exceeds the size of every eligible node's pool "
                                            f"(the largest is {max(c[1] for c in caps.values())} bytes)")
        free = {n: c[0] for n, c in caps.items()}
        fits = sorted((n for n in free if free[n] >= size), key=lambda n: (-free[n], n))
        if not fits:
            raise NoNodeFits(site=self.site, reason=f"{size} bytes; the most free on an eligible node "
                                                    f"is {max(free.values())} bytes")
        for term in preferred:
            for n in fits:
                if matches(self.topologies[n], term):
                    return n
        return fits[0]

    def total(self, topology: dict | None, capabilities, parameters: dict | None) -> Capacity:
        """The nodes in *topology* (all without it): their free space added up, the largest
        volume one of them can hold, the smallest any accepts. Nodes that do not answer are
        left out; none answering is UNAVAILABLE."""
        nodes = [n for n, t in self.topologies.items() if not topology or matches(t, topology)]
        if not nodes:
            return Capacity(0, 0, 0)
        kwargs = {"capabilities": caps_out(capabilities), "parameters": dict(parameters or {})}
        answers = {n: r for n, r in self.calls.call_each(dict.fromkeys(nodes, kwargs), "capacity",
                                                         wait=self.probe_wait).items()
                   if not isinstance(r, DrsvcError)}
        if not answers:
            raise NodeUnreachable(node=", ".join(nodes), site=self.site, wait=self.probe_wait,
                                  reason="no node in that topology answered")
        return Capacity(sum(a[0] for a in answers.values()), max(a[1] for a in answers.values()),
                        min(a[2] for a in answers.values()))
