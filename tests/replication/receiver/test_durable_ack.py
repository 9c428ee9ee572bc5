"""A peer that acknowledges "durable" ([peers.<name>] ack): the commit answers once the
journal and its marker are durable, and the undo copy, the apply and the recovery point
follow the answer under the unit's lock. Real receivers (LocalPeer: the receiver program
in a process of its own) on loop XFS."""
from __future__ import annotations

import os
import random

import pytest

from drsvc import store
from drsvc.config import load as load_config
from drsvc.errors import ConfigInvalid
from drsvc.layout import PoolLayout
from drsvc.replication import peer_status, sync_unit
from drsvc.replication.common.unit_state import get_state
from drsvc.replication.points.index import Index, build_image
from drsvc.replication.receiver import wait_for_applies
from drsvc.replication.control.peers import connect
from drsvc.transport.local import LocalPeer

from ..conftest import make_image, new_sites, sha, write_at

MiB = 1 << 20
GRID = {"site": "a", "interval": 60, "kind": "volume", "volumes": {}, "retention": "1x1000w(keep=all)"}


def durable(pool, **kw) -> LocalPeer:
    peer = LocalPeer(pool, **kw)
    peer.ack = "durable"
    return peer


def scatter(path, rnd: random.Random, count: int = 300) -> None:
    """Scattered 4 KiB writes: each one's old block goes to the point's undo copy."""
    size = os.path.getsize(path)
    for _ in range(count):
        write_at(path, rnd.randrange(0, size // 4096) * 4096, rnd.randbytes(4096))


def shipped(a, gen: int) -> str:
    return sha(PoolLayout(a).snap_dir("v", gen) / "v.img")


def test_the_answer_comes_before_the_apply_and_every_point_still_rebuilds(xfs_mod):
    """The answer carries no apply time (it did not wait for one); the receive record
    carries what followed it; a status right after the sync, in a process of its own,
    already reads the new generation (it waits on the unit's lock); and every recovery
    point rebuilds to the bytes shipped at its generation. A unit's first copy overwrites
    nothing: it answers once applied, so the unit is known at the peer when it returns."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    rnd = random.Random(7)
    make_image(img, 16 * MiB, [(0, rnd.randbytes(16 * MiB))])
    peer = durable(b)
    gens, shas = [], {}
    for i in range(4):
        r = sync_unit(a, "v", ["v"], peer, origin=GRID)
        assert "peer_sync_s" in r.phases and ("peer_apply_s" in r.phases) == (i == 0)
        if i == 0:
            assert get_state(b, "v").generation == r.target_generation     # read without any lock
        assert peer_status(LocalPeer(b), "v")["generation"] == r.target_generation
        gens.append(r.target_generation)
        shas[r.target_generation] = shipped(a, r.target_generation)   # the sender keeps only its base
        scatter(img, rnd)
    wait_for_applies(PoolLayout(b))
    st = get_state(b, "v")
    after = st.received[-1]["after_answer"]
    assert after["apply_s"] > 0 and after["behind_s"] >= after["apply_s"]
    # the last sync overwrote kept blocks: all copied after the answer, none during the stream
    assert after["undo_s"] > 0 and after["undo_ahead_s"] == 0
    assert sha(b / "images" / "v.img") == shas[gens[-1]]
    layout = PoolLayout(b)
    idx = Index.find(layout, "v")
    assert [p.generation for p in idx.points] == gens
    for p in idx.points:
        out = b / "check.img"
        build_image(layout, idx, p, "v", out)
        assert sha(out) == shas[p.generation], f"point {p.generation}"
        out.unlink()


@pytest.mark.parametrize("point", ["receiver.mid_apply", "receiver.after_apply", "receiver.after_state"])
def test_a_receiver_killed_after_its_durable_answer_loses_nothing(xfs_mod, point):
    """kill -9 after the answer, inside the apply that follows it: the sync succeeded (the
    generation was durable), the next contact replays the committed journal, and the next
    sync goes on from the acked generation without a finalize."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    rnd = random.Random(point)
    make_image(img, 16 * MiB, [(0, rnd.randbytes(16 * MiB))])
    sync_unit(a, "v", ["v"], durable(b), origin=GRID)
    scatter(img, rnd)
    write_at(img, 12 * MiB, rnd.randbytes(256 << 10))     # a second record: mid_apply lands between
    r = sync_unit(a, "v", ["v"], durable(b, env={"DRSVC_FAILPOINTS": point}), origin=GRID)
    assert get_state(a, "v").generation == r.target_generation
    journal = PoolLayout(b).journal_commit("v")
    if point != "receiver.after_state":
        assert store.read_doc(journal) is not None and get_state(b, "v").generation < r.target_generation
    assert peer_status(LocalPeer(b), "v")["generation"] == r.target_generation   # the replay
    assert not journal.exists()
    assert sha(b / "images" / "v.img") == shipped(a, r.target_generation)
    scatter(img, rnd, 20)
    nxt = sync_unit(a, "v", ["v"], durable(b), origin=GRID)
    assert nxt.steps == ["sync"]
    wait_for_applies(PoolLayout(b))
    assert sha(b / "images" / "v.img") == sha(img)


def test_a_demote_is_applied_before_its_answer(xfs_mod):
    """A Demote's final sync answers only once applied, whatever the peer's ack: the
    Promote that follows at once must find the replica at the target."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    rnd = random.Random(3)
    make_image(img, 8 * MiB, [(0, rnd.randbytes(8 * MiB))])
    sync_unit(a, "v", ["v"], durable(b), origin=GRID)
    scatter(img, rnd, 50)
    r = sync_unit(a, "v", ["v"], durable(b), origin=GRID, demote=True)
    assert "peer_apply_s" in r.phases
    assert get_state(b, "v").generation == r.target_generation     # read without any lock
    assert sha(b / "images" / "v.img") == shipped(a, r.target_generation)


def test_ack_is_a_peer_setting(tmp_path):
    """``ack`` in a [peers.<name>] table reaches the Peer ("durable" unless it says so);
    anything but the two values is a clear configuration error."""
    def site(ack_line: str):
        cfg = tmp_path / "drsvc.toml"
        cfg.write_text(f'site = "a"\npool = "{tmp_path / "pool"}"\n[peers.b]\ntransport = "local"\n'
                       f'pool = "{tmp_path / "b"}"\n{ack_line}\n')
        return load_config(cfg)
    assert connect(site("").peer("b")).ack == "durable"
    assert connect(site('ack = "applied"').peer("b")).ack == "applied"
    with pytest.raises(ConfigInvalid, match="ack"):
        site('ack = "eventually"')
