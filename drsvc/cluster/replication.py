"""The Replication RPCs of a multi-node site (drsvc.controller_api.ReplicationControl): each
runs on the node holding the unit, where the node's own requests dispatch the job to its
control queue and wait for it (a node's api worker runs nothing else, so it never waits
on itself).

A volume group whose members sit on several nodes replicates as one part per node
(``group_rounds``): each call goes to every part at once (their syncs meet at the
cut), and a promote first settles any round left prepared at this site's nodes, so
every part takes over at the same generation."""
from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import DrsvcError, GroupNotFound, NotGroupConsistent, VolumeNotFound
from ..replication.control import PROMOTE_ALL_WAIT_S, Info
from .routing import Router
from .wire import group_in

log = logging.getLogger(__name__)


def settle_plan(states: dict[str, dict]) -> dict[str, bool]:
    """For each node holding a prepared round (``replica.round_state``): apply it (True)
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


class ClusterReplication:
    def __init__(self, router: Router, *, rpc_wait: float = 20.0):
        self.router = router
        self.wait = router.wait + rpc_wait      # the node's own wait for its job, and the trip

    def _node(self, kind: str, ident: str) -> str:
        if kind == "group":
            return self.router.holder_of(ident, "volume_group_id", GroupNotFound(group_id=ident))
        return self.router.holder_of(ident, "volume_id", VolumeNotFound(volume_id=ident))

    def parts(self, kind: str, ident: str) -> list[str]:
        """The nodes a unit's calls go to: its node, or every node of a spanning group."""
        node = self._node(kind, ident)
        if kind != "group":
            return [node]
        g = group_in(self.router.call(node, "get_group", {"group_id": ident})).group
        return sorted(g.nodes) if len(g.nodes) > 1 else [node]

    def _call(self, method: str, kind: str, ident: str, **kwargs) -> Any:
        nodes = self.parts(kind, ident)
        call = {"method": method, "kind": kind, "ident": ident, **kwargs}
        if len(nodes) == 1:
            return self.router.call(nodes[0], "replication", call, wait=self.wait)
        out = self.router.call_all({n: call for n in nodes}, "replication", wait=self.wait)
        return [out[n] for n in nodes]

    def enable(self, kind: str, ident: str, params: dict) -> None:
        self._call("enable", kind, ident, params=dict(params))

    def disable(self, kind: str, ident: str, params: dict) -> None:
        self._call("disable", kind, ident, params=dict(params))

    def promote(self, kind: str, ident: str, force: bool, params: dict | None = None) -> None:
        nodes = self.parts(kind, ident)
        if len(nodes) > 1:
            self.settle(ident, nodes)
        self._call("promote", kind, ident, force=force, params=dict(params or {}))

    def promote_all(self, force: bool, *, dry_run: bool = False, wait: float = 0.0) -> list[dict]:
        """A site failover: every unit this site holds as secondary. Each node takes its own
        units as one batch (``NodeOps.op_promote_all``), all nodes at once; a group spanning
        nodes is then promoted as its own PromoteVolume is, settled across its parts first.
        Returns a row per unit (one per spanning group), as the nodes report them."""
        return self._site_batch("promote_all", {"force": force}, dry_run=dry_run, would="would promote",
                                wait=wait, per_unit=PROMOTE_ALL_WAIT_S,
                                spanning=lambda row: self._promote_spanning(row, force))

    def demote_all(self, *, resync: bool = False, dry_run: bool = False, wait: float = 0.0) -> list[dict]:
        """A site's failback: every unit this site holds as primary, demoted (and with
        *resync* resynced with force) in one batch per node (``NodeOps.op_demote_all``), all
        nodes at once; a group spanning nodes is demoted as its own DemoteVolume is, each
        part in turn. Returns a row per unit (one per spanning group), as the nodes report them."""
        return self._site_batch("demote_all", {"resync": resync}, dry_run=dry_run, would="would demote",
                                wait=wait, per_unit=PROMOTE_ALL_WAIT_S * (2 if resync else 1),
                                spanning=lambda row: self._demote_spanning(row, resync))

    def _site_batch(self, op: str, args: dict, *, dry_run: bool, would: str, wait: float, per_unit: float,
                    spanning) -> list[dict]:
        """*op* over the whole site: every node lists its units (``dry_run``), then each takes
        the units only it holds as one batch with *args*, all nodes at once (*wait*: 0 for
        *per_unit* seconds a unit of the longest batch past the rpc wait); a unit listed by
        several nodes (a group spanning them) goes by itself after the batches, through
        *spanning* (its listed row -> its result row)."""
        listed = self.router.call_all({n: {"dry_run": True} for n in self.router.nodes}, op)
        parts: dict[str, list] = {}
        for n in self.router.nodes:
            for row in listed[n]:
                parts.setdefault(row["unit_id"], []).append(row)
        if dry_run:
            return [{**rows[0], "result": would} for _u, rows in sorted(parts.items())]
        batches = {n: [r["unit_id"] for r in listed[n] if len(parts[r["unit_id"]]) == 1] for n in self.router.nodes}
        longest = max((len(b) for b in batches.values()), default=0)
        node_wait = wait or self.wait + per_unit * longest
        out = self.router.calls.call_each({n: {**args, "units": b, "wait": node_wait}
                                           for n, b in batches.items() if b}, op, wait=node_wait + self.wait)
        rows = []
        for n, result in sorted(out.items()):
            if isinstance(result, DrsvcError):       # the node did not answer: its units, failed
                result = [{"unit_id": u, "result": "failed", "error": type(result).__name__,
                           "message": result.message} for u in batches[n]]
            rows += [{**parts[r["unit_id"]][0], **r} for r in result]
        return rows + [spanning(parts[u][0]) for u in sorted(u for u, rows in parts.items() if len(rows) > 1)]

    def _demote_spanning(self, row: dict, resync: bool) -> dict:
        t0 = time.monotonic()
        out = {"result": "failed"}
        try:
            self.demote("group", row["unit_id"], False)
            out["result"] = "demoted"
            if resync:
                out["resync"] = "ready" if self.resync("group", row["unit_id"], True) else "requested"
        except DrsvcError as e:
            if out["result"] == "demoted":
                out["resync"] = "failed"
            out.update(error=type(e).__name__, message=e.message)
        return {**row, **out, "seconds": round(time.monotonic() - t0, 4)}

    def _promote_spanning(self, row: dict, force: bool) -> dict:
        t0 = time.monotonic()
        try:
            self.promote("group", row["unit_id"], force)
            out = {"result": "promoted"}
        except DrsvcError as e:
            out = {"result": "failed", "error": type(e).__name__, "message": e.message}
        return {**row, **out, "seconds": round(time.monotonic() - t0, 4)}

    def settle(self, unit_id: str, nodes: list[str]) -> int:
        """Bring every part of a spanning group to one generation before it takes over.

        A round prepared on some nodes was decided commit at the origin only if every
        part voted, and a part applies only after the decision: so if any node applied
        the round, it is applied on all of them; otherwise it is dropped on all."""
        states = self.router.call_all({n: {"unit_id": unit_id} for n in nodes}, "round_state")
        for n, commit in settle_plan(states).items():
            p = states[n]["prepared"]
            out = self.router.call(n, "settle_round", {"unit_id": unit_id, "txid": p["txid"], "commit": commit})
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
