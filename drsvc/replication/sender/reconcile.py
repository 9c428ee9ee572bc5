"""The steps a sync takes, given this end's acked generation and the peer's status.

Pure: nothing here does I/O. A state the two ends cannot both be in is a typed conflict.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ReplicaIsPrimary, ReplicationConflict


@dataclass(frozen=True)
class Pending:
    """A captured and planned generation that the peer has not been seen to commit."""
    generation: int
    txid: str
    members: tuple


def reconcile(unit_id: str, acked: int, pending: Pending | None, peer: dict, members,
              mode: str = "delta") -> list[str]:
    """Steps to take given our acked generation and the peer's status.

    Returns a list among "settle" (carry a two-phase round's decision to the peer:
    ``peer["journal"]["decision"]``), "finalize" (the peer committed our pending generation:
    adopt it), "discard" (drop the pending generation), "resume" (stream the
    pending generation again; the peer keeps what it acked), "sync" (capture and
    send a new generation), "compare". Raises a typed conflict otherwise.
    """
    if peer.get("role") == "primary":
        raise ReplicaIsPrimary(unit_id=unit_id)
    if peer.get("resync_requested"):
        mode = "compare"          # the peer discards its divergence: diff against its blocks
    peer_gen = int(peer.get("generation") or 0)
    peer_txid = peer.get("txid")
    steps: list[str] = []
    jr = peer.get("journal") or {}
    if jr.get("prepared"):
        # a two-phase round (group spanning nodes) awaits its decision, read while connecting
        steps.append("settle")
        if jr.get("decision"):
            peer_gen, peer_txid = int(jr["target"]), jr["txid"]
        elif pending is not None and pending.txid == jr.get("txid"):
            steps.append("discard")
            pending = None
    if pending is not None:
        if peer_gen == pending.generation and peer_txid == pending.txid:
            steps.append("finalize")
            acked = pending.generation
            pending = None
        elif mode == "compare" or peer_gen != acked or tuple(members) != tuple(pending.members):
            steps.append("discard")
            pending = None
    if mode == "compare":
        return steps + ["compare"]
    if peer_gen != acked:
        if not peer.get("exists") and acked > 0:
            reason = f"peer has no replica but generation {acked} was acknowledged; a compare sync is needed"
        else:
            reason = (f"peer is at generation {peer_gen} but generation {acked} was acknowledged; "
                      "a compare sync is needed")
        raise ReplicationConflict(unit_id=unit_id, reason=reason)
    return steps + (["resume"] if pending is not None else ["sync"])
