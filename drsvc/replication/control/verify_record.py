"""A secondary's verify record (``verify.json``) and what the status makes of it.

Written by the verify job (``scrub``), read by the read model, the CLI's status and
/metrics: small, and importing nothing of the engine's sides, so the plugin reads it
without loading the receiver.
"""
from __future__ import annotations

import time

from ... import store
from ...errors import PointKnownBad, ReplicaKnownBad
from ...layout import PoolLayout


class VerifyRecord:
    """``verify.json``: ``last`` (the last run), ``failure`` (the last run that found the
    replica's blocks different, kept until a complete clean run or a repair), ``repair`` (a
    compare sync asked for), ``last_complete_at`` (when the last run that read everything
    ended), ``points`` (what the last run that checked the recovery points found: damaged
    ones stay reported until a run finds them clean or gone; no repair exists for them)."""

    def __init__(self, layout: PoolLayout, unit_id: str):
        self.path = layout.verify_path(unit_id)
        self.doc = store.read_doc(self.path) or {}

    @classmethod
    def find(cls, pool, unit_id: str) -> VerifyRecord:
        return cls(PoolLayout(pool), unit_id)

    def add(self, run: dict) -> None:
        d = self.doc
        d["last"] = run
        replica = run.get("replica_result", run["result"])
        if replica == "mismatch":
            d["failure"], d["repair"] = run, None
        elif replica == "clean":
            d["failure"], d["repair"] = None, None
        if run.get("points") is not None:
            d["points"] = {**run["points"], "generation": run["generation"], "checked_at": run["finished_at"]}
        if run["complete"]:
            d["last_complete_at"] = run["finished_at"]
        d["runs_total"] = int(d.get("runs_total") or 0) + 1
        store.write_doc(self.path, d)

    def ask_repair(self, by: str = "compare") -> None:
        """*by*: how the primary re-sends the blocks (``delta``: by name; ``compare``)."""
        self.doc["repair"] = {"requested_at": time.time(), "by": by,
                              "generation": (self.doc.get("failure") or {}).get("generation", 0)}
        store.write_doc(self.path, self.doc)

    def judge(self, st) -> dict:
        """What the status says of the unit's verify, given its state now (pure of the record)."""
        return judge(self.doc, generation=st.generation, repair_asked=repair_pending(st))


def repair_pending(st) -> bool:
    """Whether a repair asked of the primary has not committed yet (either kind)."""
    return bool(st.resync_requested or st.repair)


def judge(doc: dict, *, generation: int, repair_asked: bool) -> dict:
    """failed: mismatches known and not repaired; repaired: the sync that re-sent them committed
    after the repair was asked for (*repair_asked*, ``repair_pending``, is cleared by its
    commit, at a newer generation)."""
    fail, rep = doc.get("failure"), doc.get("repair")
    pts = doc.get("points") or {}
    repaired = bool(fail and rep and not repair_asked and generation > int(fail.get("generation") or 0))
    damaged = [int(g) for g in pts.get("damaged_points") or ()]
    out = {"last_verify_at": float(doc.get("last_complete_at") or 0.0),
           "failed": (bool(fail) and not repaired) or bool(damaged), "replica_failed": bool(fail) and not repaired,
           "damaged_points": damaged, "damaged_first": (pts.get("damaged") or [])[:3] if damaged else [],
           "unverifiable_points": sorted({int(u["point"]) for u in pts.get("unverifiable") or ()}),
           "repaired": repaired, "repair_pending": bool(fail and rep and not repaired),
           "mismatched_blocks": int(fail["mismatched_blocks"]) if fail and not repaired else 0,
           "generation": int(fail.get("generation") or 0) if fail else 0,
           "first": (fail.get("mismatches") or [])[:3] if fail and not repaired else [],
           "runs_total": int(doc.get("runs_total") or 0)}
    out["message"] = "; ".join(m for m in (failure_message(out) if out["replica_failed"] else "",
                                           points_message(out)) if m) if out["failed"] else ""
    if out["message"]:
        out["message"] = "VERIFY_FAILED: " + out["message"]
    return out


def failure_message(v: dict) -> str:
    where = ", ".join(f"{m['volume']}@{m['offset']}" for m in v["first"])
    tail = "; repair asked for: waiting for the primary's compare sync" if v["repair_pending"] else \
        "; `drsvc verify --repair` re-sends those blocks from the primary"
    return f"{v['mismatched_blocks']} block(s) of generation {v['generation']} differ (first at {where}){tail}"


def points_message(v: dict) -> str:
    """The damaged recovery points: named, and said to be beyond repair from the primary."""
    if not v["damaged_points"]:
        return ""
    where = ", ".join(f"point {m['point']} {m['volume']}@{m['offset']}" for m in v["damaged_first"])
    return (f"recovery point(s) {', '.join(map(str, v['damaged_points']))} damaged (first at {where}): "
            "the primary keeps no older generations, so they cannot be repaired; a promote to them "
            "is refused unless forced, and they go when retention prunes them")


def point_known_bad(v: dict, generation: int) -> int | None:
    """The damaged point an image of point *generation* is built through (itself or a newer
    one: its undo log is laid over the newer points'), or None."""
    bad = [g for g in v["damaged_points"] if g >= generation]
    return min(bad) if bad else None


def refuse_known_bad(pool, st, point: int | None, *, action: str) -> None:
    """Refuse to *action* (promote, clone) a replica its last verify found damaged, or a
    recovery point built through a damaged one (a point's image is the replica with the undo
    logs of it and every newer point laid over it). Taking it on is the operator's call (force)."""
    v = VerifyRecord.find(pool, st.unit_id).judge(st)
    if v["replica_failed"]:
        raise ReplicaKnownBad(unit_id=st.unit_id, detail=failure_message(v), action=action)
    if point is not None and (bad := point_known_bad(v, point)) is not None:
        where = ", ".join(f"{m['volume']}@{m['offset']}" for m in v["damaged_first"] if m["point"] == bad)
        raise PointKnownBad(unit_id=st.unit_id, generation=point, damaged=bad, action=action,
                            detail=f"damaged at {where}" if where else "damaged")
