"""The peer's side: the only program the replication key may run there.

- ``program``: the program (``main``): the verb table, its dispatch and I/O
  (``python -m drsvc.replication.receiver``, the forced command of authorized_keys);
- ``verbs``: the verbs' bodies; ``transaction``: one delta transaction, begin to trailer;
- ``journal``: records made durable first, then applied atomically;
- ``stripe_join``: a stripe channel's stream handed to its transaction's receiver;
- ``replica``: the replica's state here: recover, record, settle, status (also used by the
  secondary's own processes: a promote, a drill);
- ``image_guard``: never write into an image something holds read-write;
- ``origin_block``: what the secondary must know of the primary's unit to take it over;
- ``commit_points``: the recovery points a commit makes and prunes;
- ``undo_copy``: a point's undo copy, made while the records arrive.

May import ``common``, ``wire`` and ``points``: never the sender or control. Imports stay
lean (this starts once per channel).
"""
from __future__ import annotations

from ..common.exports import lazy_exports

_EXPORTS = {"main": "program", "round_state": "replica", "settle_round": "replica", "recover": "replica",
            "wait_for_applies": "replica", "wait_for_apply": "replica"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
