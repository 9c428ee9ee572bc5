"""Block-delta replication engine.

Entry points for the control plane (loaded on first use, so ``python -m
drsvc.replication.receiver`` starts without loading the sender side):

    sync_unit(pool, unit_id, members, peer, *, mounts=no_mounts, epoch=None, demote=False,
              mode="delta"|"compare", ...) -> SyncReport
    verify_unit(pool, unit_id, peer) -> VerifyReport
    peer_status(peer, unit_id) -> dict
    release_peer(peer, unit_id, *, delete_image=False) -> dict
    release_unit(pool, unit_id) -> bool
    state.set_role / state.bump_epoch / state.mark_demoted / state.find_state / state.get_state
"""
from __future__ import annotations

_EXPORTS = {
    "sync_unit": "sync", "release_unit": "snapstore",
    "verify_unit": "verify",
    "peer_status": "remote", "release_peer": "remote", "hello": "remote",
    "SyncReport": "report", "VerifyReport": "report",
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(name)
    from . import remote, report, snapstore, sync, verify
    modules = {"sync": sync, "snapstore": snapstore, "verify": verify, "remote": remote, "report": report}
    return getattr(modules[_EXPORTS[name]], name)


__all__ = sorted(_EXPORTS)
