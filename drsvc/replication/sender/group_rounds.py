"""How the parts of a volume group that spans storage nodes agree, sync after sync.

A group whose members sit on several nodes replicates as one *part* per node:
the part holds that node's members under the group's unit id, on the node's
pool, and ships to the node's peer node. Each sync of a part is one *round* of
the group, run by the node's own worker at the same schedule slot (the slot
comes from the unit id) or by the same control call (demote):

1. **Cut.** Each part freezes its mounted members and calls :meth:`Cut.frozen`,
   which returns once every part is frozen (the round's id), or raises
   ``NotGroupConsistent`` after a short wait; only then does any part clone.
   Every part's generation holds the same instant. A Demote's final round meets
   only the other parts' final rounds (never a scheduled round that happens to be
   at the same generation), so the demotion mark reaches every peer node or none.
2. **Prepare.** Each part streams its delta as a two-phase transaction: the
   peer node journals it durably and votes (``prepared``) instead of applying.
3. **Decide.** :meth:`Cut.vote` records the vote; once every part voted the
   round commits, and a part that fails or times out aborts it. There is one
   decision per round, taken once (first writer wins), and every part carries
   it to its receiver (``decide``) before it adopts or drops the generation.
   A part that crashed in between settles the round at its next sync
   (:meth:`Cut.decision`: no decision recorded means abort).

At the peer site a promote settles what was left prepared without the sending
site (which may be gone): a round that any node applied was decided commit, so
it is applied everywhere; otherwise it is dropped everywhere
(``drsvc.cluster.ClusterReplication``). Either way every node of the group
ends at the same generation.

This module is the interface; the site's Redis implements it at the edge
(``workers.client.RedisCut``).
"""
from __future__ import annotations

import logging
from typing import Protocol

from ...errors import DrsvcError

log = logging.getLogger(__name__)


class Cut(Protocol):
    parts: int

    def frozen(self, epoch: int, generation: int) -> str:
        """Called with this part's members frozen, before it clones; returns the round's
        id once every part is frozen at *generation*, or raises NotGroupConsistent."""

    def vote(self, round_id: str) -> bool:
        """This part's receiver prepared the round: True (commit) once every part has,
        False when the round was aborted or the others did not vote in time."""

    def fail(self, round_id: str) -> None:
        """This part cannot prepare the round: abort it, unless it was already decided."""

    def decision(self, round_id: str) -> bool:
        """The round's decision; a round left undecided is aborted now (presumed abort)."""


def abandon(cut: Cut | None, round_id: str | None) -> None:
    """This part cut *round_id* and will not send its generation (it failed after the cut,
    or dropped a capture its plan did not take): abort the round, so that a part which
    prepared it stops waiting for this vote at once instead of the vote's whole wait, its
    unit's lock held all along. Safe whenever this part has not voted: without its vote the
    round cannot have been decided commit. Best effort: with the broker away, the other
    parts' votes time out as before."""
    if cut is None or not round_id:
        return
    try:
        cut.fail(round_id)
    except DrsvcError as e:
        log.warning("round %s could not be aborted (%s); the other parts' votes time out", round_id, e.message)
