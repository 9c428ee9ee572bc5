"""Replication unit state: typed load/save (atomic via drsvc.store) and role changes.

One document per unit, ``POOL/replication/<unit_id>/state.json``, on both
sites. On the sender ``generation`` is the last generation the peer
acknowledged; on the receiver it is the generation applied to the replica.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ... import schedule_changes, store
from ...errors import CorruptMetadata, InvalidParameter, UnitNotFound
from ...layout import PoolLayout, check_id
from .blockmap import DEFAULT_BLOCK_SIZE

ROLES = ("primary", "secondary")
KINDS = ("volume", "group")
MAX_REPORTS = 20


@dataclass
class UnitState:
    unit_id: str
    kind: str = "volume"
    members: list = field(default_factory=list)
    role: str = "primary"
    epoch: int = 0
    generation: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    sizes: dict = field(default_factory=dict)
    peer: str | None = None
    txid: str | None = None            # transaction that produced `generation`
    demoted: bool = False              # this site gave up the primary role (planned failover)
    demoted_at: int | None = None
    peer_demoted_at: int | None = None  # receiver: the primary demoted itself at this generation
    reports: list = field(default_factory=list)
    updated_at: float = 0.0
    diverged: bool = False             # demoted holding writes the peer lacks: no deltas until resync
    resync_requested: bool = False     # receiver: the next sync must be a compare sync
    # receiver: a verify's repair asked for, {"id", "generation", "runs": {volume: [[offset,
    # length]]}}: the primary's next delta re-sends those blocks too, and its commit clears it
    repair: dict = field(default_factory=dict)
    origin: dict = field(default_factory=dict)  # receiver: the primary's site, schedule and volumes
    received: list = field(default_factory=list)  # receiver: receive records, newest last (health.py)
    receiving_since: float = 0.0       # receiver: the first commit this site received in its current role

    def to_doc(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_doc(cls, doc: dict, path="state.json") -> UnitState:
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            st = cls(**{k: v for k, v in doc.items() if k in names})
        except TypeError as e:
            raise CorruptMetadata(path=str(path), reason=str(e)) from None
        if st.role not in ROLES or st.kind not in KINDS:
            raise CorruptMetadata(path=str(path), reason=f"bad role/kind {st.role}/{st.kind}")
        return st

    def add_report(self, report: dict) -> None:
        self.reports = (self.reports + [report])[-MAX_REPORTS:]

    def add_received(self, record: dict) -> None:
        self.received = (list(self.received or []) + [record])[-MAX_REPORTS:]


def find_state(pool, unit_id: str) -> UnitState | None:
    layout = PoolLayout(pool)
    path = layout.state_path(unit_id)
    doc = store.read_doc(path)
    return None if doc is None else UnitState.from_doc(doc, path)


def get_state(pool, unit_id: str) -> UnitState:
    st = find_state(pool, unit_id)
    if st is None:
        raise UnitNotFound(unit_id=unit_id)
    return st


def save_state(pool, st: UnitState) -> None:
    layout = PoolLayout(pool)
    layout.ensure_unit_dir(st.unit_id)
    st.updated_at = time.time()
    store.write_doc(layout.state_path(st.unit_id), st.to_doc())


def _locked_update(pool, unit_id: str, fn) -> UnitState:
    layout = PoolLayout(pool)
    layout.ensure_unit_dir(unit_id)
    with store.file_lock(layout.lock_path(unit_id), key=unit_id):
        st = get_state(pool, unit_id)
        role = st.role
        fn(st)
        save_state(pool, st)
    if st.role != role:      # the scheduler syncs primaries only
        schedule_changes.mark(pool, unit_id)
    return st


def ensure_unit(pool, unit_id: str, members, *, kind: str | None = None, role: str = "primary",
                peer: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> UnitState:
    """Create the unit's state if missing; an existing unit is returned unchanged."""
    check_id(unit_id)
    for m in members:
        check_id(m, "volume id")
    st = find_state(pool, unit_id)
    if st is None:
        kind = kind or ("group" if len(members) != 1 or members[0] != unit_id else "volume")
        if kind not in KINDS or role not in ROLES:
            raise InvalidParameter(key="kind/role", reason=f"{kind}/{role}")
        st = UnitState(unit_id=unit_id, kind=kind, members=list(members), role=role, peer=peer,
                       block_size=block_size)
        save_state(pool, st)
        schedule_changes.mark(pool, unit_id)
    return st


def set_role(pool, unit_id: str, role: str) -> UnitState:
    if role not in ROLES:
        raise InvalidParameter(key="role", reason=f"must be one of {ROLES}")

    def change(st):
        st.role = role
        if role == "primary":
            st.demoted = False
    return _locked_update(pool, unit_id, change)


def bump_epoch(pool, unit_id: str) -> UnitState:
    """Forced promotion: a new epoch fences deltas from the old primary."""
    def change(st):
        st.epoch += 1
    return _locked_update(pool, unit_id, change)


def mark_demoted(pool, unit_id: str, generation: int | None = None) -> UnitState:
    """Planned failover: this site stops being primary after `generation`."""
    def change(st):
        st.role = "secondary"
        st.demoted = True
        st.demoted_at = st.generation if generation is None else generation
    return _locked_update(pool, unit_id, change)


def mark_diverged(pool, unit_id: str, diverged: bool = True) -> UnitState:
    def change(st):
        st.diverged = diverged
    return _locked_update(pool, unit_id, change)


def request_resync(pool, unit_id: str) -> UnitState:
    """A demoted copy asks the primary to overwrite its divergence (compare sync)."""
    def change(st):
        if st.role != "secondary":
            raise InvalidParameter(key="role", reason=f"{unit_id} is {st.role}; only a secondary resyncs")
        st.resync_requested = True
    return _locked_update(pool, unit_id, change)


def request_repair(pool, unit_id: str, generation: int, runs: dict) -> UnitState:
    """A verify asks the primary to re-send these mismatched block runs with its next delta."""
    def change(st):
        if st.role != "secondary":
            raise InvalidParameter(key="role", reason=f"{unit_id} is {st.role}; only a secondary is repaired")
        import uuid      # only a repair needs one; not every receiver run
        st.repair = {"id": uuid.uuid4().hex, "generation": generation, "runs": runs}
    return _locked_update(pool, unit_id, change)


def promote(pool, unit_id: str) -> UnitState:
    """Become primary in a new epoch: deltas from the previous epoch are fenced off."""
    def change(st):
        st.role = "primary"
        st.epoch += 1
        st.receiving_since = 0.0
        st.demoted, st.demoted_at, st.peer_demoted_at = False, None, None
        st.diverged = st.resync_requested = False
        st.repair = {}
    return _locked_update(pool, unit_id, change)
