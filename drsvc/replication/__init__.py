"""Block-delta replication engine.

Entry points for the control plane (imported lazily, so ``python -m
drsvc.replication.receiver`` starts without loading the sender side):

    sync_unit(pool, unit_id, members, peer, *, mountpoints=(), epoch=None, demote=False,
              mode="delta"|"compare", ...) -> SyncReport
    verify_unit(pool, unit_id, peer) -> VerifyReport
    peer_status(peer, unit_id) -> dict
    release_peer(peer, unit_id, *, delete_image=False) -> dict
    release_unit(pool, unit_id) -> bool
    state.set_role / state.bump_epoch / state.mark_demoted / state.find_state / state.get_state
"""
from __future__ import annotations

_EXPORTS = {
    "sync_unit": "sender", "release_unit": "sender",
    "verify_unit": "verify",
    "peer_status": "remote", "release_peer": "remote", "hello": "remote",
    "SyncReport": "report", "VerifyReport": "report",
}


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(name)
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


__all__ = sorted(_EXPORTS)
