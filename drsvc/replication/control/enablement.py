"""EnableVolumeReplication as the CSI-Addons controllers call it.

The VolumeReplication controller calls Enable before every Promote, and a
VolumeReplicationClass is cluster-scoped and the same at both sites of a pair
(kubernetes-csi-addons internal/controller/replication.storage/). So Enable
must succeed on a unit that already replicates here in either role, and the
class's ``peer`` may name either site of the pair.
"""
from __future__ import annotations

from ...errors import GroupEmpty, InvalidParameter
from ..common import unit_state


def resolve_peer(cfg, requested: str) -> str:
    """The peer to replicate to. No peer, or this site's own name (the class is the same
    at both sites), means the only peer; a name no site of the pair has is invalid."""
    peers = sorted(cfg.peers)
    if not requested or requested == cfg.site:
        if len(peers) == 1:
            return peers[0]
        raise InvalidParameter(key="peer", reason=f"site {cfg.site} has {len(peers)} peers "
                                                  f"({', '.join(peers) or 'none'}): name one")
    if requested not in cfg.peers:
        raise InvalidParameter(key="peer", reason=f"site {cfg.site} has no peer named {requested[:64]!r}; "
                                                  f"known: {', '.join(peers + [cfg.site])}")
    return requested


def replicated_as_secondary(pool, unit_id: str) -> bool:
    """Enable at the site holding the replica: replication exists, so it is a no-op."""
    st = unit_state.find_state(pool, unit_id)
    return st is not None and st.role == "secondary"


def check_group_has_members(unit) -> None:
    if unit.kind == "group" and not unit.members:
        raise GroupEmpty(group_id=unit.unit_id)
