"""A site of several storage nodes: the controller that holds no pool, and the node side.

The site config lists the nodes (``[nodes.<name>]``). Each node runs a worker on its own
queue; :class:`ClusterController` answers the CSI controller calls by placing volumes on
nodes and sending every call that touches a pool to the node holding the object, as a
task (:class:`NodeCalls`, implemented over Celery by workers.client.NodeDispatcher). On
the node, :class:`NodeOps` runs the call on the node's own pool with a
:class:`drsvc.controller.PoolController`.

Routing needs no table: the ids a node hands out start with its name (``n1.vol-…``,
``n1.snap-…``). A client-chosen name is claimed for one node in the site's Redis before
the node creates anything, so a retried CreateVolume lands on the node that holds the
first attempt's volume, whatever capacity says by then.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import asdict
from typing import Any, Protocol

from .config import SiteConfig
from .controller import Capacity, GroupView, PoolController, VolumeStatus
from .errors import (BadPageToken, CapacityOutOfRange, Conflict, DrsvcError, GroupNotFound, GroupSnapshotExists,
                     GroupSnapshotNotFound, GroupSpansNodes, MissingField, NotGroupConsistent, NoNodeFits, NodeUnreachable,
                     ReplicationNotConfigured, SnapshotExists, SnapshotListMismatch, SnapshotNotFound,
                     VolumeNotFound)
from .groups import Group
from .ids import check_id, check_map, check_name, name_key
from .model import Capability, ContentSource, Page, Snapshot, Volume
from .modify import check_mutable
from .replication.status import Info
from .snapshots import GroupSnapshot
from .volumes import DEFAULT_CAPACITY, check_capabilities, node_topology, pair_zone

log = logging.getLogger(__name__)


class NodeCalls(Protocol):
    def call(self, node: str, op: str, kwargs: dict, *, wait: float) -> Any:
        """Run *op* on *node*'s pool and return its JSON result; a domain error raised there
        is raised here with its class; NodeUnreachable when the node does not answer."""

    def call_each(self, calls: dict[str, dict], op: str, *, wait: float) -> dict:
        """*op* on several nodes at once, each with its kwargs ({node: kwargs}): node ->
        result, or the DrsvcError it ended with."""

    def holder(self, key: str) -> str | None:
        """The node *key* (a client-chosen name) is claimed for, if any."""

    def claim(self, key: str, node: str) -> str:
        """Claim *key* for *node* unless it is claimed already: the holder."""

    def release(self, key: str, node: str) -> None:
        """Drop *key*'s claim if *node* holds it."""

    def bind(self, object_id: str, key: str) -> None:
        """Remember which name's claim *object_id* holds (so a delete can drop it even when
        the node no longer knows the object: a retried delete whose first answer was lost)."""

    def unbind(self, object_id: str) -> str | None:
        """Forget *object_id*'s name; the name key it held, if any."""


# -- the wire between the controller and a node's task: JSON only -----------------------
def _caps_out(caps) -> list[dict]:
    return [{"access_type": c.access_type, "access_mode": c.access_mode, "fs_type": c.fs_type,
             "mount_flags": list(c.mount_flags)} for c in caps]


def _caps_in(docs) -> list[Capability]:
    return [Capability(d["access_type"], d["access_mode"], d.get("fs_type", ""),
                       tuple(d.get("mount_flags", ()))) for d in docs or ()]


def _status_out(st: VolumeStatus) -> dict:
    return {"volume": st.volume.to_doc(), "published_node_ids": st.published_node_ids, "problem": st.problem}


def _status_in(doc: dict) -> VolumeStatus:
    return VolumeStatus(Volume.from_doc(doc["volume"]), list(doc["published_node_ids"]), doc["problem"])


def _group_out(view: GroupView) -> dict:
    return {"group": view.group.to_doc(), "volumes": [v.to_doc() for v in view.volumes]}


def _group_in(doc: dict) -> GroupView:
    return GroupView(Group.from_doc(doc["group"]), [Volume.from_doc(v) for v in doc["volumes"]])


class Barrier(Protocol):
    def wait(self) -> None:
        """Arrive, and return once every party has arrived; raise when one is not in time."""


def _gs_out(gs, members) -> dict:
    return {"gs": gs.to_doc(), "members": [m.to_doc() for m in members]}


def _gs_in(doc: dict):
    return GroupSnapshot.from_doc(doc["gs"]), [Snapshot.from_doc(m) for m in doc["members"]]


class NodeOps:
    """The node side: one call from the site's controller, on this node's pool."""

    def __init__(self, ctl: PoolController, replication=None, barrier=None):
        self.ctl = ctl
        self.volumes = ctl.site.volumes
        self.replication = replication      # drsvc.replication.api.ReplicationAPI, with peers
        self.barrier = barrier              # (key, parties, timeout) -> Barrier, from the edge

    def op_create_group_snapshot(self, name: str, source_volume_ids, parameters=None) -> dict:
        return _gs_out(*self.ctl.create_group_snapshot(name, source_volume_ids, parameters))

    def op_group_snapshot_part(self, group_snapshot_id: str, name: str, source_volume_ids, snapshot_ids,
                               parameters, nodes, barrier: str, timeout: float) -> dict:
        """This node's part of a group snapshot across nodes: freeze, meet every other node
        at the barrier, clone, thaw."""
        gss = self.ctl.group_snapshots
        gs = gss.create_part(group_snapshot_id, name, source_volume_ids, snapshot_ids, parameters, nodes,
                             self.barrier(barrier, len(nodes), timeout))
        return _gs_out(gs, gss.members(gs))

    def op_get_group_snapshot(self, group_snapshot_id: str, snapshot_ids=()) -> dict:
        return _gs_out(*self.ctl.get_group_snapshot(group_snapshot_id, snapshot_ids))

    def op_delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids=()) -> None:
        self.ctl.delete_group_snapshot(group_snapshot_id, snapshot_ids)

    def run(self, op: str, kwargs: dict) -> Any:
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise DrsvcError(f"unknown node operation {op!r}")
        return handler(**kwargs)

    def op_probe(self) -> None:
        self.ctl.probe()

    def op_create_volume(self, name: str, capabilities=(), source=None, **kw) -> dict:
        src = ContentSource(source["kind"], source["source_id"]) if source else None
        return self.ctl.create_volume(name, capabilities=_caps_in(capabilities), source=src, **kw).to_doc()

    def op_delete_volume(self, volume_id: str) -> str:
        """Delete; the name key whose claim the controller may drop ('' if there was none)."""
        vol = self.volumes.find_volume(check_id(volume_id))
        self.ctl.delete_volume(volume_id)
        return name_key("volume", vol.name) if vol is not None else ""

    def op_validate(self, volume_id: str, capabilities=(), parameters=None) -> str:
        return self.ctl.validate(volume_id, _caps_in(capabilities), parameters or {})

    def op_get_volume(self, volume_id: str) -> dict:
        return _status_out(self.ctl.get_volume(volume_id))

    def op_list_volumes(self, max_entries: int = 0, token: str = "") -> dict:
        page = self.ctl.list_volumes(max_entries, token)
        return {"items": [_status_out(st) for st in page.items], "next_token": page.next_token}

    def op_capacity(self, topology=None, capabilities=(), parameters=None) -> list:
        c = self.ctl.capacity(topology, _caps_in(capabilities), parameters or {})
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

    def op_create_group(self, name: str, parameters=None, volume_ids=()) -> dict:
        return _group_out(self.ctl.create_group(name, parameters, volume_ids))

    def op_modify_group(self, group_id: str, volume_ids=(), parameters=None) -> dict:
        return _group_out(self.ctl.modify_group(group_id, volume_ids, parameters))

    def op_delete_group(self, group_id: str) -> str:
        g = self.ctl.site.groups.find(check_id(group_id, "volume_group_id"))
        self.ctl.delete_group(group_id)
        return name_key("group", g.name) if g is not None else ""

    def op_get_group(self, group_id: str) -> dict:
        return _group_out(self.ctl.get_group(group_id))

    def op_list_groups(self, max_entries: int = 0, token: str = "", home_only: bool = False) -> dict:
        """home_only: leave out the parts of spanning groups whose home is another node."""
        page = self.ctl.list_groups(max_entries, token)
        home = f"{self.ctl.site.node_id}."
        return {"items": [_group_out(v) for v in page.items
                          if not (home_only and v.group.nodes and not v.group.group_id.startswith(home))],
                "next_token": page.next_token}

    def op_ensure_group_part(self, group_id: str, name: str, parameters, volume_ids, nodes) -> dict:
        g = self.ctl.site.groups.ensure_part(group_id, name=name, parameters=parameters or {},
                                            volume_ids=volume_ids, nodes=nodes)
        return _group_out(self.ctl._view(g))

    def op_forget_group_part(self, group_id: str) -> None:
        self.ctl.site.groups.forget_part(group_id)

    def op_replication(self, method: str, kind: str, ident: str, **kwargs) -> Any:
        """A Replication RPC on a unit of this node (drsvc.replication.api.ReplicationAPI)."""
        if self.replication is None:
            raise ReplicationNotConfigured(site=self.ctl.site_name)
        if method not in REPLICATION_METHODS:
            raise DrsvcError(f"unknown replication call {method!r}")
        out = getattr(self.replication, method)(kind, ident, **kwargs)
        return asdict(out) if isinstance(out, Info) else out

    def op_round_state(self, unit_id: str) -> dict:
        """A spanning group's part here: applied generation, and a round left prepared."""
        from .replication.replica import round_state
        return round_state(self.ctl.site.pool.layout, check_id(unit_id, "volume_group_id"))

    def op_settle_round(self, unit_id: str, txid: str, commit: bool) -> dict:
        from .replication.replica import settle_round
        return settle_round(self.ctl.site.pool.layout, check_id(unit_id, "volume_group_id"),
                            check_id(txid, "transaction id"), bool(commit))

    def op_list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                          source_volume_id: str = "") -> dict:
        page = self.ctl.list_snapshots(max_entries, token, snapshot_id, source_volume_id)
        return {"items": [s.to_doc() for s in page.items], "next_token": page.next_token}


REPLICATION_METHODS = ("enable", "disable", "promote", "demote", "resync", "info", "sync_now")


class ClusterReplication:
    """The Replication RPCs of a multi-node site: each runs on the node holding the unit,
    where the node's own requests dispatch the job to its control queue and wait for it
    (a node's api worker runs nothing else, so it never waits on itself).

    A volume group whose members sit on several nodes replicates as one part per node
    (``replication.cut``): each call goes to every part at once (their syncs meet at the
    cut), and a promote first settles any round left prepared at this site's nodes, so
    every part takes over at the same generation."""

    def __init__(self, ctl: ClusterController, *, rpc_wait: float = 20.0):
        self.ctl = ctl
        self.wait = ctl.wait + rpc_wait      # the node's own wait for its job, and the trip

    def _node(self, kind: str, ident: str) -> str:
        check_id(ident, "volume_group_id" if kind == "group" else "volume_id")
        node = self.ctl.node_of(ident)
        if node is None:
            if kind == "group":
                raise GroupNotFound(group_id=ident)
            raise VolumeNotFound(volume_id=ident)
        return node

    def parts(self, kind: str, ident: str) -> list[str]:
        """The nodes a unit's calls go to: its node, or every node of a spanning group."""
        node = self._node(kind, ident)
        if kind != "group":
            return [node]
        g = _group_in(self.ctl.calls.call(node, "get_group", {"group_id": ident}, wait=self.ctl.wait)).group
        return sorted(g.nodes) if len(g.nodes) > 1 else [node]

    def _call(self, method: str, kind: str, ident: str, **kwargs) -> Any:
        nodes = self.parts(kind, ident)
        call = {"method": method, "kind": kind, "ident": ident, **kwargs}
        if len(nodes) == 1:
            return self.ctl.calls.call(nodes[0], "replication", call, wait=self.wait)
        out = self.ctl.calls.call_each({n: call for n in nodes}, "replication", wait=self.wait)
        failed = [r for r in out.values() if isinstance(r, DrsvcError)]
        if failed:
            raise failed[0]
        return [out[n] for n in nodes]

    def enable(self, kind: str, ident: str, params: dict) -> None:
        self._call("enable", kind, ident, params=dict(params))

    def disable(self, kind: str, ident: str, params: dict) -> None:
        self._call("disable", kind, ident, params=dict(params))

    def promote(self, kind: str, ident: str, force: bool) -> None:
        nodes = self.parts(kind, ident)
        if len(nodes) > 1:
            self.settle(ident, nodes)
        self._call("promote", kind, ident, force=force)

    def settle(self, unit_id: str, nodes: list[str]) -> int:
        """Bring every part of a spanning group to one generation before it takes over.

        A round prepared on some nodes was decided commit at the origin only if every
        part voted, and a part applies only after the decision: so if any node applied
        the round, it is applied on all of them; otherwise it is dropped on all."""
        calls = self.ctl.calls
        states = calls.call_each({n: {"unit_id": unit_id} for n in nodes}, "round_state", wait=self.ctl.wait)
        failed = [r for r in states.values() if isinstance(r, DrsvcError)]
        if failed:
            raise failed[0]
        for n, commit in settle_plan(states).items():
            p = states[n]["prepared"]
            out = calls.call(n, "settle_round", {"unit_id": unit_id, "txid": p["txid"], "commit": commit},
                             wait=self.ctl.wait)
            log.info("group %s: round %s (generation %s) left prepared on %s: %s", unit_id, p["round"],
                     p["target"], n, "applied, as another node had" if commit else "dropped, as no node applied it")
            states[n]["generation"] = out.get("generation", states[n]["generation"])
        gens = {n: st["generation"] for n, st in states.items()}
        if len(set(gens.values())) > 1:
            raise NotGroupConsistent(reason=f"the parts of group {unit_id} hold different generations "
                                            f"({', '.join(f'{n}: {g}' for n, g in sorted(gens.items()))})")
        return next(iter(gens.values()))

    def demote(self, kind: str, ident: str, force: bool) -> None:
        self._call("demote", kind, ident, force=force)

    def resync(self, kind: str, ident: str, force: bool) -> bool:
        out = self._call("resync", kind, ident, force=force)
        return all(out) if isinstance(out, list) else bool(out)

    def info(self, kind: str, ident: str) -> Info:
        out = self._call("info", kind, ident)
        if not isinstance(out, list):
            return Info(**out)
        return combine_info([Info(**d) for d in out])

    def sync_now(self, kind: str, ident: str, wait: float | None = None) -> dict:
        out = self._call("sync_now", kind, ident, wait=wait)
        return out if isinstance(out, dict) else {"parts": out}


def settle_plan(states: dict[str, dict]) -> dict[str, bool]:
    """For each node holding a prepared round (``receiver.round_state``): apply it (True)
    when another node already applied that generation, else drop it (False)."""
    plan = {}
    for n, st in sorted(states.items()):
        p = st["prepared"]
        if p is not None:
            plan[n] = any(o["generation"] == p["target"] and o["prepared"] is None
                          for m, o in states.items() if m != n)
    return plan


def combine_info(parts: list[Info]) -> Info:
    """One group's replication info from its parts: the oldest sync and the worst health,
    so a part that lags is the group's lag."""
    worst = max(parts, key=lambda i: (i.status != "HEALTHY", i.lag_seconds, i.consecutive_failures))
    roles = {i.role for i in parts}
    return Info(role=worst.role if len(roles) > 1 else parts[0].role, epoch=max(i.epoch for i in parts),
                generation=min(i.generation for i in parts), peer=parts[0].peer, interval=parts[0].interval,
                last_sync_time=min(i.last_sync_time for i in parts),
                last_sync_duration=max(i.last_sync_duration for i in parts),
                last_sync_bytes=sum(i.last_sync_bytes for i in parts), status=worst.status,
                status_message=worst.status_message if len(roles) == 1 else
                f"parts disagree on the role ({', '.join(sorted(roles))}); {worst.status_message}",
                lag_seconds=max(i.lag_seconds for i in parts),
                missed_intervals=max(i.missed_intervals for i in parts),
                consecutive_failures=max(i.consecutive_failures for i in parts),
                failures_total=sum(i.failures_total for i in parts),
                schedule_delay=max(i.schedule_delay for i in parts))


def _dig(doc: dict, path: str):
    """doc['a']['b'] for path 'a.b'."""
    for part in path.split("."):
        doc = doc[part]
    return doc


def _matches(topology: dict, term: dict) -> bool:
    return all(topology.get(k) == v for k, v in term.items())


class ClusterController:
    """The CSI controller calls of a multi-node site, each sent to the node it concerns."""

    SUSPECT_FOR = 30.0    # a node that did not answer is left out of placement this long

    def __init__(self, cfg: SiteConfig, calls: NodeCalls, *, wait: float | None = None, probe_wait: float = 2.0):
        self.cfg = cfg
        self.calls = calls
        self.wait = wait or cfg.node_call_timeout   # one node call
        self.probe_wait = probe_wait                # capacity asked of every node while placing
        self._suspect: dict[str, float] = {}        # node -> monotonic time it is asked again
        zone = pair_zone(cfg.site, cfg.peers, cfg.zone)
        self.topologies = {n: node_topology(zone, c.pair, c.labels) for n, c in sorted(cfg.nodes.items())}
        # node names may hold dots (FQDNs): an id "<node>.<local id>" names the longest that fits
        self._longest_first = sorted(cfg.nodes, key=len, reverse=True)

    @property
    def site_name(self) -> str:
        return self.cfg.site

    # -- routing -------------------------------------------------------------------
    def node_of(self, object_id: str) -> str | None:
        """The node an id names (None: not an id of this site's nodes)."""
        for node in self._longest_first:
            if object_id.startswith(node) and object_id[len(node):len(node) + 1] == ".":
                return node
        return None

    def _on(self, object_id: str, what: str, missing: DrsvcError, op: str, **kwargs) -> Any:
        node = self.node_of(check_id(object_id, what))
        if node is None:
            raise missing
        return self.calls.call(node, op, {what: object_id, **kwargs}, wait=self.wait)

    def probe(self) -> None:
        """Ready when at least one storage node answers."""
        results = self.calls.call_each(dict.fromkeys(self.cfg.nodes, {}), "probe", wait=self.probe_wait)
        if all(isinstance(r, DrsvcError) for r in results.values()):
            raise NodeUnreachable(node="(all)", site=self.cfg.site, wait=self.probe_wait,
                                  reason="no storage node answered")

    # -- placement -----------------------------------------------------------------
    def _capacities(self, nodes: list[str], capabilities) -> dict[str, list]:
        """[free, maximum, minimum] bytes of each node that answers in time, asked now (a
        cached answer would hide a node that just died, and pin a name's claim to it). A
        node that did not answer is left out, and not asked again for SUSPECT_FOR seconds,
        so a dead node does not slow every placement down; when it is the only candidate it
        is asked all the same."""
        now = time.monotonic()
        ask = [n for n in nodes if self._suspect.get(n, 0) <= now] or nodes
        out = {}
        kwargs = {"capabilities": _caps_out(capabilities)}
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
                    if not requisite or any(_matches(t, term) for term in requisite)]
        if not eligible:
            raise NoNodeFits(site=self.cfg.site, reason=f"no node is in the requisite topology {requisite}")
        caps = self._capacities(eligible, capabilities)
        if not caps:
            raise NodeUnreachable(node=", ".join(eligible), site=self.cfg.site, wait=self.probe_wait,
                                  reason="no eligible node answered")
        if all(size > c[1] for c in caps.values()):
            # larger than any eligible node's whole pool: no placement ever fits, the range is
            # what is wrong (OUT_OF_RANGE, as a one-node site's plugin answers)
            raise CapacityOutOfRange(reason=f"{size} bytes exceeds the size of every eligible node's pool "
                                            f"(the largest is {max(c[1] for c in caps.values())} bytes)")
        free = {n: c[0] for n, c in caps.items()}
        fits = sorted((n for n in free if free[n] >= size), key=lambda n: (-free[n], n))
        if not fits:
            raise NoNodeFits(site=self.cfg.site, reason=f"{size} bytes; the most free on an eligible node "
                                                        f"is {max(free.values())} bytes")
        for term in preferred:
            for n in fits:
                if _matches(self.topologies[n], term):
                    return n
        return fits[0]

    # -- a named object: its name claimed for a node, made there, remembered by id ---------
    def _make(self, key: str, holder: str, made: bool, op: str, kwargs: dict, id_field: str) -> dict:
        """Run the create *op* on *holder*; *made*: this call claimed the name. A failure that
        created nothing lets the name go (a retry may place it afresh); a conflict or a node
        that did not answer keeps it with its node (a retry must find its object there).
        The new object's id remembers its name's key, for the delete."""
        try:
            doc = self.calls.call(holder, op, kwargs, wait=self.wait)
        except (Conflict, NodeUnreachable):
            raise
        except DrsvcError:
            if made:
                self.calls.release(key, holder)
            raise
        self.calls.bind(_dig(doc, id_field), key)
        return doc

    def _unmake(self, node: str, op: str, id_field: str, object_id: str) -> None:
        """Run the delete *op*, then drop the name's claim: by the key the node names, or,
        when the node no longer knows the object (a retry whose first answer was lost), by
        the key its id remembers."""
        key = self.calls.call(node, op, {id_field: object_id}, wait=self.wait)
        key = self.calls.unbind(object_id) or key
        if key:
            self.calls.release(key, node)

    # -- volumes -------------------------------------------------------------------
    def create_volume(self, name: str, *, required_bytes: int = 0, limit_bytes: int = 0,
                      capabilities: list[Capability] = (), parameters: dict | None = None,
                      source: ContentSource | None = None, requisite: list[dict] = (),
                      preferred: list[dict] = (), mutable: dict | None = None) -> Volume:
        check_name(name)
        check_capabilities(list(capabilities))    # before placement, which would call them "no room"
        mutable = check_mutable(dict(mutable or {}))
        parameters = dict(check_map(parameters or {}, "parameters"))
        kwargs = {"name": name, "required_bytes": required_bytes, "limit_bytes": limit_bytes,
                  "capabilities": _caps_out(capabilities), "parameters": parameters,
                  "source": {"kind": source.kind, "source_id": source.source_id} if source else None,
                  "requisite": list(requisite), "mutable": mutable}
        key = name_key("volume", name)
        holder = self.calls.holder(key)           # a retry goes where the first attempt went
        made = False
        if holder is None:
            group = parameters.get("volumeGroup", "")
            chosen = self._group_node(group, source) if group else self._source_node(source) if source is not None \
                else self.place(required_bytes or (min(DEFAULT_CAPACITY, limit_bytes) if limit_bytes else DEFAULT_CAPACITY),
                           capabilities, list(requisite), list(preferred))
            holder = self.calls.claim(key, chosen)
            made = holder == chosen
        return Volume.from_doc(self._make(key, holder, made, "create_volume", kwargs, "volume_id"))

    def _group_node(self, group_id: str, source: ContentSource | None) -> str:
        """A group member is made on its group's node (a clone's source must be there too)."""
        node = self.node_of(check_id(group_id, "volumeGroup"))
        if node is None:
            raise GroupNotFound(group_id=group_id)
        if source is not None and self._source_node(source) != node:
            raise GroupSpansNodes(reason=f"the source {source.source_id} is not on group {group_id}'s node {node}")
        return node

    def _source_node(self, source: ContentSource) -> str:
        """A clone is made by reflink, on the node that holds its source."""
        node = self.node_of(check_id(source.source_id, "source id"))
        if node is None:
            if source.kind == "snapshot":
                raise SnapshotNotFound(snapshot_id=source.source_id)
            raise VolumeNotFound(volume_id=source.source_id)
        return node

    def delete_volume(self, volume_id: str) -> None:
        node = self.node_of(check_id(volume_id))
        if node is None:
            return          # not a volume of this site's nodes: nothing to delete
        self._unmake(node, "delete_volume", "volume_id", volume_id)

    def validate(self, volume_id: str, capabilities: list[Capability], parameters: dict) -> str:
        return self._on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "validate",
                        capabilities=_caps_out(capabilities), parameters=dict(parameters))

    def get_volume(self, volume_id: str) -> VolumeStatus:
        return _status_in(self._on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "get_volume"))

    def _pages(self, op: str, max_entries: int, token: str, kwargs: dict, decode) -> Page:
        """A page across the nodes, in node order: the token is '<node>:<that node's token>'."""
        nodes = sorted(self.cfg.nodes)
        start, inner = nodes[0], ""
        if token:
            start, colon, inner = token.partition(":")
            if not colon or start not in self.cfg.nodes:
                raise BadPageToken(token=token[:64])
        items: list = []
        for node in nodes[nodes.index(start):]:
            want = max_entries - len(items) if max_entries else 0
            page = self.calls.call(node, op, {"max_entries": want, "token": inner, **kwargs}, wait=self.wait)
            items += [decode(d) for d in page["items"]]
            inner = ""
            if page["next_token"]:
                return Page(items, f"{node}:{page['next_token']}")
            if max_entries and len(items) >= max_entries:
                later = nodes[nodes.index(node) + 1:]
                return Page(items, f"{later[0]}:" if later else "")
        return Page(items, "")

    def list_volumes(self, max_entries: int = 0, token: str = "") -> Page:
        return self._pages("list_volumes", max_entries, token, {}, _status_in)

    def capacity(self, topology: dict | None = None, capabilities: list[Capability] = (),
                 parameters: dict | None = None) -> Capacity:
        """The nodes in *topology* (all without it): their free space added up, the largest
        volume one of them can hold, the smallest any accepts. Nodes that do not answer are
        left out; none answering is UNAVAILABLE."""
        nodes = [n for n, t in self.topologies.items() if not topology or _matches(t, topology)]
        if not nodes:
            return Capacity(0, 0, 0)
        kwargs = {"capabilities": _caps_out(capabilities), "parameters": dict(parameters or {})}
        answers = {n: r for n, r in self.calls.call_each(dict.fromkeys(nodes, kwargs), "capacity",
                                                         wait=self.probe_wait).items()
                   if not isinstance(r, DrsvcError)}
        if not answers:
            raise NodeUnreachable(node=", ".join(nodes), site=self.cfg.site, wait=self.probe_wait,
                                  reason="no node in that topology answered")
        return Capacity(sum(a[0] for a in answers.values()), max(a[1] for a in answers.values()),
                        min(a[2] for a in answers.values()))

    def expand_volume(self, volume_id: str, required_bytes: int, limit_bytes: int) -> int:
        return self._on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "expand_volume",
                        required_bytes=required_bytes, limit_bytes=limit_bytes)

    def modify_volume(self, volume_id: str, mutable: dict) -> None:
        self._on(volume_id, "volume_id", VolumeNotFound(volume_id=volume_id), "modify_volume",
                 mutable=check_mutable(dict(mutable)))

    # -- snapshots -----------------------------------------------------------------
    def create_snapshot(self, name: str, source_volume_id: str, parameters: dict | None = None) -> Snapshot:
        check_name(name)
        node = self.node_of(check_id(source_volume_id, "source_volume_id"))
        if node is None:
            raise VolumeNotFound(volume_id=source_volume_id)
        key = name_key("snapshot", name)
        made = self.calls.holder(key) is None
        if self.calls.claim(key, node) != node:
            raise SnapshotExists(name=name)       # that name is a snapshot on another node
        return Snapshot.from_doc(self._make(key, node, made, "create_snapshot", {
            "name": name, "source_volume_id": source_volume_id, "parameters": dict(parameters or {})},
            "snapshot_id"))

    def delete_snapshot(self, snapshot_id: str) -> None:
        node = self.node_of(check_id(snapshot_id, "snapshot_id"))
        if node is None:
            return
        self._unmake(node, "delete_snapshot", "snapshot_id", snapshot_id)

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return Snapshot.from_doc(self._on(snapshot_id, "snapshot_id", SnapshotNotFound(snapshot_id=snapshot_id),
                                          "get_snapshot"))

    def list_snapshots(self, max_entries: int = 0, token: str = "", snapshot_id: str = "",
                       source_volume_id: str = "") -> Page:
        one = snapshot_id or source_volume_id
        if one:
            node = self.node_of(one)
            if node is None:
                return Page([], "")
            page = self.calls.call(node, "list_snapshots", {"max_entries": max_entries, "token": token,
                                                            "snapshot_id": snapshot_id,
                                                            "source_volume_id": source_volume_id}, wait=self.wait)
            return Page([Snapshot.from_doc(d) for d in page["items"]], page["next_token"])
        return self._pages("list_snapshots", max_entries, token, {}, Snapshot.from_doc)

    # -- volume groups: on one node, or in parts on several (one record per node) -----------
    def _by_node(self, volume_ids) -> dict[str, list]:
        nodes: dict[str, list] = {}
        for vid in volume_ids:
            node = self.node_of(check_id(vid))
            if node is None:
                raise VolumeNotFound(volume_id=vid)
            nodes.setdefault(node, []).append(vid)
        return nodes

    def _set_parts(self, view: GroupView, by_node: dict[str, list], home: str) -> GroupView:
        """Write every node's part of a group spanning nodes (members, and the list of
        nodes); drop the parts of nodes that no longer hold a member."""
        g = view.group
        nodes = sorted(set(by_node) | {home})
        calls = {n: {"group_id": g.group_id, "name": g.name, "parameters": dict(g.parameters),
                     "volume_ids": by_node.get(n, []), "nodes": nodes if len(nodes) > 1 else []} for n in nodes}
        out = self.calls.call_each(calls, "ensure_group_part", wait=self.wait)
        failed = [r for r in out.values() if isinstance(r, DrsvcError)]
        if failed:
            raise failed[0]
        for n in sorted(set(g.nodes) - set(nodes)):
            self.calls.call(n, "forget_group_part", {"group_id": g.group_id}, wait=self.wait)
        return self._merged([_group_in(out[n]) for n in nodes])

    @staticmethod
    def _merged(parts: list[GroupView]) -> GroupView:
        first = parts[0]
        if len(parts) == 1:
            return first
        g = Group.from_doc(first.group.to_doc())
        g.volume_ids = [v for p in parts for v in p.group.volume_ids]
        return GroupView(g, [v for p in parts for v in p.volumes])

    def create_group(self, name: str, parameters: dict | None = None, volume_ids=()) -> GroupView:
        check_name(name)
        key = name_key("group", name)
        by_node = self._by_node(volume_ids)
        holder, made = self.calls.holder(key), False
        if holder is None:
            chosen = min(by_node) if by_node else self.place(0, (), [], [])
            holder = self.calls.claim(key, chosen)
            made = holder == chosen
        view = _group_in(self._make(key, holder, made, "create_group", {
            "name": name, "parameters": dict(parameters or {}), "volume_ids": by_node.get(holder, [])},
            "group.group_id"))
        if len(by_node) > 1 or (by_node and holder not in by_node):
            log.info("volume group %s (%s) spans nodes %s", view.group.group_id, name, sorted(by_node))
            view = self._set_parts(view, by_node, holder)
        return view

    def _group_call(self, group_id: str, op: str, **kwargs):
        node = self.node_of(check_id(group_id, "volume_group_id"))
        if node is None:
            raise GroupNotFound(group_id=group_id)
        return self.calls.call(node, op, {"group_id": group_id, **kwargs}, wait=self.wait)

    def modify_group(self, group_id: str, volume_ids, parameters: dict | None = None) -> GroupView:
        home = self.node_of(check_id(group_id, "volume_group_id"))
        by_node = self._by_node(volume_ids)
        if home is not None:
            cur = _group_in(self._group_call(group_id, "get_group")).group
            if cur.nodes or set(by_node) - {home}:
                if parameters:
                    cur.parameters = {**cur.parameters, **dict(parameters)}
                return self._set_parts(GroupView(cur, []), by_node, home)
        return _group_in(self._group_call(group_id, "modify_group", volume_ids=list(volume_ids),
                                          parameters=dict(parameters or {})))

    def delete_group(self, group_id: str) -> None:
        node = self.node_of(check_id(group_id, "volume_group_id"))
        if node is None:
            return                      # names no node of this site: nothing to delete
        try:
            cur = _group_in(self._group_call(group_id, "get_group")).group
        except GroupNotFound:
            cur = None
        for n in sorted(set(cur.nodes if cur else ()) - {node}):     # the other parts first, the home last
            self.calls.call(n, "delete_group", {"group_id": group_id}, wait=self.wait)
        self._unmake(node, "delete_group", "group_id", group_id)

    def get_group(self, group_id: str) -> GroupView:
        home = self.node_of(check_id(group_id, "volume_group_id"))
        view = _group_in(self._group_call(group_id, "get_group"))
        others = [n for n in view.group.nodes if n != home]
        return self._merged([view] + [_group_in(self.calls.call(n, "get_group", {"group_id": group_id},
                                                                wait=self.wait)) for n in others])

    def list_groups(self, max_entries: int = 0, token: str = "") -> Page:
        page = self._pages("list_groups", max_entries, token, {"home_only": True}, _group_in)
        return Page([self.get_group(v.group.group_id) if len(v.group.nodes) > 1 else v for v in page.items],
                    page.next_token)

    # -- volume group snapshots: across nodes, cut in parts at one instant ----------------
    BARRIER_TIMEOUT = 5.0     # the longest a node holds its freeze waiting for the others

    def create_group_snapshot(self, name: str, source_volume_ids, parameters: dict | None = None):
        check_name(name)
        if not source_volume_ids:
            raise MissingField(field="source_volume_ids")
        sources = list(dict.fromkeys(check_id(v, "source_volume_ids") for v in source_volume_ids))
        by_node: dict[str, list] = {}
        for vid in sources:
            node = self.node_of(vid)
            if node is None:
                raise VolumeNotFound(volume_id=vid)
            by_node.setdefault(node, []).append(vid)
        params = dict(parameters or {})
        if len(by_node) == 1:
            node = next(iter(by_node))
            return _gs_in(self.calls.call(node, "create_group_snapshot", {
                "name": name, "source_volume_ids": sources, "parameters": params}, wait=self.wait))
        nodes = sorted(by_node)
        key = name_key("group-snapshot", name)
        fresh = f"{nodes[0]}.gsnap-{secrets.token_hex(12)}"
        gsid = self.calls.claim(key, fresh)
        if gsid != fresh:               # a retry, or the name is taken
            gs, members = self.get_group_snapshot(gsid)
            if sorted(gs.source_volume_ids) != sorted(sources):
                raise GroupSnapshotExists(name=name, reason="source volumes")
            if gs.state == "ready":
                return gs, members
        sid = {v: f"{n}.snap-{hashlib.sha256(f'{gsid}/{v}'.encode()).hexdigest()[:24]}"
               for n, vids in by_node.items() for v in vids}
        barrier = f"{gsid}:{secrets.token_hex(4)}"      # a fresh meeting per attempt
        kwargs = {n: {"group_snapshot_id": gsid, "name": name, "source_volume_ids": vids,
                      "snapshot_ids": [sid[v] for v in vids], "parameters": params, "nodes": nodes,
                      "barrier": barrier, "timeout": self.BARRIER_TIMEOUT} for n, vids in by_node.items()}
        parts = self.calls.call_each(kwargs, "group_snapshot_part", wait=self.wait)
        failed = {n: r for n, r in parts.items() if isinstance(r, DrsvcError)}
        if failed:
            # nothing half-made stays: the parts that were cut are removed, the name let go
            for n in nodes:
                try:
                    self.calls.call(n, "delete_group_snapshot", {"group_snapshot_id": gsid}, wait=self.wait)
                except DrsvcError as e:
                    log.warning("group snapshot %s: part on %s not removed: %s", gsid, n, e.message)
            self.calls.release(key, gsid)
            raise next(iter(failed.values()))
        gs, members = self._merge(gsid, [_gs_in(parts[n]) for n in nodes])
        log.info("group snapshot %s (%s) cut on %d nodes at one instant: the first node froze %.1f ms before "
                 "the last thawed", gsid, name, len(nodes), gs.freeze_seconds * 1e3)
        return gs, members

    @staticmethod
    def _merge(gsid: str, parts: list):
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

    def _parts(self, group_snapshot_id: str) -> list:
        home = self.node_of(check_id(group_snapshot_id, "group_snapshot_id"))
        if home is None:
            raise GroupSnapshotNotFound(group_snapshot_id=group_snapshot_id)
        first = _gs_in(self.calls.call(home, "get_group_snapshot", {"group_snapshot_id": group_snapshot_id},
                                       wait=self.wait))
        others = [n for n in first[0].nodes if n != home]
        return [first] + [_gs_in(self.calls.call(n, "get_group_snapshot", {"group_snapshot_id": group_snapshot_id},
                                                 wait=self.wait)) for n in others]

    def get_group_snapshot(self, group_snapshot_id: str, snapshot_ids=()):
        parts = self._parts(group_snapshot_id)
        if len(parts) == 1 and not parts[0][0].nodes:
            gs, members = parts[0]               # cut on one node: its own record says it all
        else:
            gs, members = self._merge(group_snapshot_id, parts)
        given = list(snapshot_ids)
        if given and sorted(set(given)) != sorted(gs.snapshot_ids):
            raise SnapshotListMismatch(group_snapshot_id=group_snapshot_id,
                                       reason=f"not members: {sorted(set(given) - set(gs.snapshot_ids))}; "
                                              f"members not named: {sorted(set(gs.snapshot_ids) - set(given))}")
        return gs, members

    def delete_group_snapshot(self, group_snapshot_id: str, snapshot_ids=()) -> None:
        if self.node_of(check_id(group_snapshot_id, "group_snapshot_id")) is None:
            return
        try:
            gs, _ = self.get_group_snapshot(group_snapshot_id, snapshot_ids)
        except GroupSnapshotNotFound:
            return
        for n in (gs.nodes or [self.node_of(group_snapshot_id)])[::-1]:     # the home part last
            self.calls.call(n, "delete_group_snapshot", {"group_snapshot_id": group_snapshot_id}, wait=self.wait)
        self.calls.release(name_key("group-snapshot", gs.name), group_snapshot_id)
