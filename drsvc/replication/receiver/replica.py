"""The replica's state at the receiving site: recover, record, settle, status.

Both sides import this module: the receiver's verbs, and the secondary's own
processes (a promote settles a round left prepared, a drill clones a replica, a
resync compares content), which act on the replica without a receiver. The
unit's lock (:class:`UnitLock`, waited for) keeps them apart from a delta landing.
"""
from __future__ import annotations

import time

from ... import schedule_changes, store
from ...errors import OperationInProgress, ReplicaIsPrimary, ReplicationConflict
from ...failpoints import failpoint
from ...layout import PoolLayout
from ..common.unit_state import UnitState, find_state, save_state
from . import commit_points
from . import origin_block as unit_origin
from .image_guard import ensure_members_not_in_use
from .journal import Journal

LOCK_WAIT = 30.0


class UnitLock:
    """The unit's flock, waited for: a receiver of a just-dropped connection may still be exiting.

    *for_peer*: taken for a peer's sync (the status verb, and the apply conversation that
    carries its status, hashes and deltas). Where this site is primary for the unit, and the
    lock is taken, the session is refused at once (ReplicaIsPrimary, a split brain to
    the peer) instead of waiting: a primary takes no deltas, and its own sync may hold the
    lock while it waits on that very peer. Two primaries syncing to each other on the same
    schedule would otherwise each wait for the lock the other's sync holds, time out after
    LOCK_WAIT, and meet again at the next interval, and neither would report the conflict."""

    def __init__(self, layout: PoolLayout, unit_id: str, *, for_peer: bool = False):
        self.layout, self.unit_id, self.for_peer = layout, unit_id, for_peer
        self._cm = None

    def __enter__(self):
        self.layout.ensure_unit_dir(self.unit_id)
        deadline = time.monotonic() + LOCK_WAIT
        pause = 0.001
        while True:
            cm = store.file_lock(self.layout.lock_path(self.unit_id), blocking=False, key=self.unit_id)
            try:
                cm.__enter__()
                self._cm = cm
                return self
            except OperationInProgress:
                if self.for_peer and self._primary_here():
                    raise ReplicaIsPrimary(unit_id=self.unit_id) from None
                if time.monotonic() > deadline:
                    raise
                # the holder is most often a receiver exiting just after its answer (a
                # Promote right after the Demote's final sync): try again soon, then back off
                time.sleep(pause)
                pause = min(0.05, pause * 2)

    def _primary_here(self) -> bool:
        st = find_state(self.layout.root, self.unit_id)    # written whole (rename): a consistent read
        return st is not None and st.role == "primary"

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


def recover(layout: PoolLayout, unit_id: str) -> Journal:
    """Finish a committed journal (idempotent replay). An uncommitted one is kept for resume,
    a prepared one (two-phase) for its round's decision."""
    j = Journal(layout, unit_id)
    if j.load() and j.committed():
        st = find_state(layout.root, unit_id)
        if st is None or st.txid != j.tx["txid"]:
            ensure_members_not_in_use(layout, unit_id, [m["volume_id"] for m in j.tx["members"]])
            j.apply_all()
            record_generation(layout, j.tx)
        j.discard()
    return j


def record_generation(layout: PoolLayout, tx: dict, *, began: float | None = None,
                      nbytes: int = 0, after_answer: dict | None = None) -> UnitState:
    """Record the applied *tx* as the replica's generation: state, recovery point, receive
    record. *after_answer*: the seconds the commit spent after answering the sender (the
    undo copy's wait, the apply; ``behind_s`` from the answer to the apply's end), kept in
    the receive record."""
    st = find_state(layout.root, tx["unit"])
    # what the scheduler keys a replica's verify on: held at all, and the class's interval
    before = (st.generation, (st.origin or {}).get("verify_interval")) if st is not None else (0, None)
    st = st or UnitState(unit_id=tx["unit"], role="secondary")
    st.kind = tx["kind"]
    st.members = [m["volume_id"] for m in tx["members"]]
    st.sizes = {m["volume_id"]: m["size"] for m in tx["members"]}
    st.generation = tx["target"]
    st.epoch = max(st.epoch, tx["epoch"])
    st.block_size = tx["block_size"]
    st.txid = tx["txid"]
    st.peer = tx.get("peer")
    if tx.get("demote"):
        st.peer_demoted_at = tx["target"]
    if tx["mode"] == "compare":
        st.diverged = st.resync_requested = False
    if tx["mode"] == "compare" or (st.repair and tx.get("repair") == st.repair.get("id")):
        st.repair = {}          # the blocks a verify found were re-sent: the repair is done
    if tx.get("origin"):
        st.origin = tx["origin"]
        unit_origin.ensure_replicas(layout.root, tx["unit"], tx["kind"], tx["origin"])
    commit_points.after_commit(layout, tx)      # the new recovery point; pruning
    now = time.time()   # the receive record (read by control.health)
    st.receiving_since = st.receiving_since or now     # a verify never run is owed from here
    received = {"generation": tx["target"], "txid": tx["txid"], "received_at": now,
                "duration_s": round(now - began, 4) if began else 0.0, "bytes": int(nbytes),
                "captured_at": tx.get("captured_at")}
    if after_answer:
        received["after_answer"] = after_answer
    st.add_received(received)
    save_state(layout.root, st)
    if not before[0] or (st.origin or {}).get("verify_interval") != before[1]:
        schedule_changes.mark(layout.root, st.unit_id)
    return st




def wait_for_applies(layout: PoolLayout) -> list[str]:
    """Wait until no receiver in this pool is applying a committed journal, and return the
    units waited for. A commit answers once its marker is durable and applies after the
    answer, holding the unit's lock (``transaction``): taking that lock and letting it go
    waits for the apply. A journal whose receiver died stays as it is, for the replay at the
    next contact. For whatever reads a replica's files without the lock: a bench's or a
    test's comparison of images."""
    units = sorted(p.parent.parent.name for p in layout.replication.glob("*/journal/commit.json"))
    for unit_id in units:
        wait_for_apply(layout, unit_id)
    return units


def wait_for_apply(layout: PoolLayout, unit_id: str) -> bool:
    """Wait until no receiver is applying the unit's committed journal (``wait_for_applies``,
    for one unit); whether the unit had one."""
    if not layout.journal_commit(unit_id).exists():
        return False
    with UnitLock(layout, unit_id):
        return True


def status_of(layout: PoolLayout, unit_id: str, journal: Journal | None = None) -> dict:
    st = find_state(layout.root, unit_id)
    msg = {"type": "status", "unit": unit_id, "exists": st is not None, "role": "secondary",
           "generation": 0, "epoch": 0, "txid": None, "members": [], "sizes": {}, "kind": None,
           "block_size": None, "peer_demoted_at": None, "demoted": False, "journal": None}
    if st is not None:
        msg.update(role=st.role, generation=st.generation, epoch=st.epoch, txid=st.txid,
                   members=st.members, sizes=st.sizes, kind=st.kind, block_size=st.block_size,
                   peer_demoted_at=st.peer_demoted_at, demoted=st.demoted,
                   diverged=st.diverged, resync_requested=st.resync_requested,
                   repair=st.repair or None)
    j = journal or Journal(layout, unit_id)
    if j.tx or j.load():
        msg["journal"] = {"txid": j.tx["txid"], "base": j.tx["base"], "target": j.tx["target"],
                          "committed": j.committed(), "prepared": j.prepared(), "round": j.tx.get("round")}
    return msg


# -- two-phase rounds (a volume group whose members sit on several storage nodes) --------
def settle(layout: PoolLayout, unit_id: str, txid: str, commit: bool) -> dict:
    """Carry out a round's decision on this unit's prepared journal; repeat-safe.

    commit: mark it committed and apply it, as a one-phase commit trailer does;
    abort: drop it. A txid already applied answers committed again; the caller
    holds the unit lock."""
    j = Journal(layout, unit_id)
    st = find_state(layout.root, unit_id)
    if j.load() and j.tx["txid"] == txid and j.prepared():
        if not commit:
            j.discard()
            return {"type": "aborted", "txid": txid}
        if st is not None and st.role == "primary":
            raise ReplicaIsPrimary(unit_id=unit_id)
        vote = store.read_doc(j.prepared_path)
        ensure_members_not_in_use(layout, unit_id, [m["volume_id"] for m in j.tx["members"]])
        j.mark_committed(vote["records"], vote["manifest"])
        failpoint("receiver.after_decide_marker")
        applied = j.apply_all()
        st = record_generation(layout, j.tx)
        j.discard()
        return {"type": "committed", "generation": st.generation, "txid": txid, "epoch": st.epoch,
                "cloned_bytes": applied.cloned, "copied_bytes": applied.copied}
    if st is not None and st.txid == txid:
        return {"type": "committed", "generation": st.generation, "txid": txid, "epoch": st.epoch,
                "cloned_bytes": 0, "copied_bytes": 0}
    if commit:
        raise ReplicationConflict(unit_id=unit_id, reason=f"transaction {txid} is neither prepared nor applied here")
    return {"type": "aborted", "txid": txid}


def round_state(layout: PoolLayout, unit_id: str) -> dict:
    """What a promote reads on every node of a spanning group: the applied generation and
    the prepared one, if any."""
    with UnitLock(layout, unit_id):
        j = recover(layout, unit_id)
        st = find_state(layout.root, unit_id)
        prepared = None
        if j.tx and j.prepared():
            prepared = {"txid": j.tx["txid"], "target": j.tx["target"], "round": j.tx.get("round")}
        return {"exists": st is not None, "generation": st.generation if st else 0,
                "txid": st.txid if st else None, "role": st.role if st else "secondary", "prepared": prepared}


def settle_round(layout: PoolLayout, unit_id: str, txid: str, commit: bool) -> dict:
    with UnitLock(layout, unit_id):
        return settle(layout, unit_id, txid, commit)
