"""Block-delta replication engine, in rooms (docs/design/README.md has the map):

    common/    what both ends share: range sets, extent ranges, block maps, unit state
    wire/      the protocol between the ends: frames, stripe tokens
    points/    recovery points: the index, undo logs, restoring one
    sender/    the primary's side: capture, plan, records, stream, sessions to the receiver
    receiver/  the peer's side: the forced-command program, transactions, journal, replica
    control/   the site's control plane: requests (plugin), jobs (worker), records, read model

Outside code imports this package and the room packages only; each names its public
surface and loads a module on the first use of one of its names, so ``python -m
drsvc.replication.receiver`` starts without loading the sender side:

    sync_unit(pool, unit_id, members, peer, *, mounts=no_mounts, epoch=None, demote=False,
              mode="delta"|"compare", ...) -> SyncReport
    verify_unit(pool, unit_id, peer) -> VerifyReport
    peer_status(peer, unit_id) -> dict
    release_peer(peer, unit_id, *, delete_image=False) -> dict
    release_unit(pool, unit_id) -> bool
"""
from __future__ import annotations

from .common.exports import lazy_exports

_EXPORTS = {
    "sync_unit": "sender.sync", "release_unit": "sender.base_store",
    "verify_unit": "sender.verify",
    "peer_status": "sender.receiver_client", "release_peer": "sender.receiver_client",
    "hello": "sender.receiver_client",
    "SyncReport": "sender.reports", "VerifyReport": "sender.reports",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
