"""A copy that waits on its primary's sync asks for it now, and never fails for asking."""
from __future__ import annotations

import pytest

from drsvc.errors import PeerUnreachable, UnknownVerb
from drsvc.replication.control import consistency

pytestmark = pytest.mark.fast


class _Peer:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("error", [PeerUnreachable(peer="b", reason="connection refused"),
                                   UnknownVerb(verb="soon"), ConnectionResetError()])
def test_a_primary_away_or_of_an_older_release_is_not_an_error(monkeypatch, error):
    """The primary unreachable, or a release whose receiver has no ``soon`` verb (it answers
    UnknownVerb), or the channel reset: False, the peer closed, nothing raised (the sync
    comes at the primary's slot instead)."""
    peer = _Peer()

    def refuse(_peer, _unit):
        raise error
    monkeypatch.setattr(consistency, "ask_soon", refuse)
    assert consistency.ask_primary_soon(lambda: peer, "u1") is False
    assert peer.closed


def test_a_resync_waiting_asks_again_only_after_a_while(monkeypatch, tmp_path):
    """ResyncVolume is polled: while the copy waits, its primary is asked again at most once
    every ASK_AGAIN_S, not at every poll."""
    asked = []
    monkeypatch.setattr(consistency, "ask_soon", lambda _p, unit: asked.append(unit) or {"asked": True})
    monkeypatch.setattr(consistency, "get_state",
                        lambda _pool, _unit: type("St", (), {"resync_requested": True})())
    consistency._asked_at.pop("u2", None)
    for _ in range(3):
        assert consistency.resync_step(tmp_path, "u2", force=True, open_peer=_Peer)["ready"] is False
    assert asked == ["u2"]
    consistency._asked_at["u2"] -= consistency.ASK_AGAIN_S
    consistency.resync_step(tmp_path, "u2", force=True, open_peer=_Peer)
    assert asked == ["u2", "u2"]
