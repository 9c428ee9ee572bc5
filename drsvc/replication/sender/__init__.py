"""The primary's side: capture a unit at one instant, plan its records, ship them.

- ``sync``: ``sync_unit``, the composition point: the unit's lock, the driver, the planner;
- ``driver``: plan -> steps -> report, and a new plan after a temporary failure;
- ``reconcile``: the steps a sync takes, given this end's records and the peer's status;
- ``steps``: the step objects (prepare, ship, adopt, discard, ...);
- ``prepare``: one generation: capture every member, then plan its records;
- ``capture``: the members' content at one instant (full clones or overlays, a pre-copy);
- ``capture_feed``: plan entries that follow the pre-copy, so records leave while it clones;
- ``changes``: what changed since the base: ranges to hash and to clear, changed block runs;
- ``records``: the plan file: hashing the planned ranges into entries, reading records back;
- ``generation``: a generation prepared for sending (its directory and meta.json);
- ``base_store``: the acked base, a pending generation, adoption;
- ``stream``: one prepared generation sent as a transaction; ``striping``: over how many channels;
- ``receiver_client``: the receiver's verbs over a transport.Peer, warm sessions;
- ``group_rounds``: how the parts of a group spanning nodes agree, round after round;
- ``verify``: block hashes of the acked base against the replica;
- ``reports``, ``progress``: what a sync reports, and a running sync's progress file.

May import ``common`` and ``wire``: never the receiver, the points or control.
"""
from __future__ import annotations

from ..common.exports import lazy_exports

_EXPORTS = {
    "sync_unit": "sync", "verify_unit": "verify", "release_unit": "base_store",
    "generation_image": "base_store", "wait_for_roll": "base_store",
    "peer_status": "receiver_client", "release_peer": "receiver_client", "hello": "receiver_client",
    "warm": "receiver_client", "discard_idle": "receiver_client",
    "SyncReport": "reports", "VerifyReport": "reports", "progress_of": "progress",
    "prepare_generation": "prepare:prepare",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
