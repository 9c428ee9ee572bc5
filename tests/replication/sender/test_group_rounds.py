"""A volume group whose members sit on two storage nodes replicates as two parts, each
from its node's pool to its peer node's pool, meeting at a cut in a real redis-server
(workers.client.RedisCut): one capture instant, two-phase commits at the receivers, one
decision per round. Receivers are real (drsvc.replication.receiver over LocalPeer); the
sender that dies between its vote and the decision is a real process SIGKILLed at the
failpoint ``sender.after_vote``."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import redis

from drsvc.cluster import settle_plan
from drsvc.errors import NotGroupConsistent, RoundAborted
from drsvc.replication import sync_unit
from drsvc.layout import PoolLayout
from drsvc.replication.receiver.replica import round_state, settle_round
from drsvc.replication.common.unit_state import find_state, request_resync
from drsvc.transport.local import LocalPeer
from tests.ops.conftest import redis_port  # noqa: F401 - the fixture
from workers.client import RedisCut

from ..conftest import make_image, sha, write_at

MiB = 1 << 20
NODES = ("n1", "n2")
GROUP = "n1.grp-span"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def span(tmp_path, xfs_mod, redis_port):  # noqa: F811 - the fixture
    """Site a: nodes n1 (volume v1) and n2 (v2); site b: its two peer nodes."""
    root = xfs_mod / tmp_path.name
    pools = {(s, n): root / s / n for s in "ab" for n in NODES}
    for p in pools.values():
        (p / "images").mkdir(parents=True)
    for n, v in zip(NODES, ("v1", "v2"), strict=True):
        make_image(pools["a", n] / "images" / f"{v}.img", 8 * MiB, [(0, os.urandom(MiB)), (5 * MiB, b"x" * 8192)])
    return {"pools": pools, "port": redis_port, "vols": {"n1": "v1", "n2": "v2"}}


def cut(span, node, **kw):
    return RedisCut(redis.Redis(port=span["port"]), "a", GROUP, node, NODES, **kw)


def part(span, node, **kw):
    """Sync one node's part of the group (its own members, to its peer node)."""
    return sync_unit(span["pools"]["a", node], GROUP, [span["vols"][node]],
                     LocalPeer(span["pools"]["b", node], name=f"b-{node}"), kind="group", **kw)


def both(span, demote=False, *, within: float | None = None, **kw):
    """Both parts' syncs at once; *within*: the seconds they must both end in."""
    out, errs = {}, {}

    def run(n):
        try:
            out[n] = part(span, n, demote=demote, cut=cut(span, n, demote=demote, **kw))
        except Exception as e:  # noqa: BLE001 - compared by the test
            errs[n] = e
    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(within)
    assert not any(t.is_alive() for t in threads), f"a part still syncing after {within}s: {out}, {errs}"
    return out, errs


def gens(span, site):
    return {n: (st.generation if (st := find_state(span["pools"][site, n], GROUP)) else 0) for n in NODES}


def same(span):
    for n, v in span["vols"].items():
        assert sha(span["pools"]["a", n] / "images" / f"{v}.img") == sha(span["pools"]["b", n] / "images" / f"{v}.img")


def test_parts_meet_and_commit_one_round_together(span):
    out, errs = both(span)
    assert not errs, errs
    assert gens(span, "a") == gens(span, "b") == {"n1": 1, "n2": 1}
    same(span)
    for n in NODES:
        write_at(span["pools"]["a", n] / "images" / f"{span['vols'][n]}.img", 3 * MiB, os.urandom(3 * 4096))
    out, errs = both(span)
    assert not errs, errs
    assert gens(span, "b") == {"n1": 2, "n2": 2}
    same(span)
    for n in NODES:
        ph = out[n].phases
        assert "cut_wait_s" in ph and "vote_s" in ph, ph
        assert find_state(span["pools"]["b", n], GROUP).received[-1]["generation"] == 2


def test_a_part_alone_cuts_nothing(span):
    with pytest.raises(NotGroupConsistent):
        part(span, "n1", cut=cut(span, "n1", freeze_wait=0.3))
    assert gens(span, "b") == {"n1": 0, "n2": 0}
    assert not any(p.name.startswith(("tmp-", "1")) for p in
                   PoolLayout(span["pools"]["a", "n1"]).snap_root(GROUP).iterdir())


def test_a_part_that_cannot_prepare_aborts_the_round_everywhere(span):
    assert not both(span)[1]
    # n2's peer node refuses the delta: its replica image is not the base it expects
    (span["pools"]["b", "n2"] / "images" / "v2.img").write_bytes(b"not the replica")
    for n in NODES:
        write_at(span["pools"]["a", n] / "images" / f"{span['vols'][n]}.img", 0, os.urandom(8192))
    out, errs = both(span, vote_wait=30)
    assert isinstance(errs.get("n1"), RoundAborted), errs
    assert "n2" in errs
    # n1's peer prepared the round but dropped it on the abort: still generation 1, no journal
    assert gens(span, "b")["n1"] == 1
    assert round_state(PoolLayout(span["pools"]["b", "n1"]), GROUP)["prepared"] is None
    assert gens(span, "a") == {"n1": 1, "n2": 1}


def test_a_part_that_drops_the_capture_it_cut_aborts_the_round_at_once(span):
    """Each part captures while its session opens, and that capture meets the cut. Here n2's
    peer node asks for a compare sync, so n2's plan drops that capture and cuts anew. n1's
    peer prepared the round they met at. n2 aborts that round as it drops its capture, and n1
    gets the abort at once. Otherwise n1 would wait out its vote's wait (here ten minutes),
    holding its unit's lock, so that no later round of the group could start."""
    assert not both(span)[1]
    request_resync(span["pools"]["b", "n2"], GROUP)
    for n in NODES:
        write_at(span["pools"]["a", n] / "images" / f"{span['vols'][n]}.img", 0, os.urandom(8192))
    out, errs = both(span, vote_wait=600, within=120)
    assert isinstance(errs.get("n1"), RoundAborted), (out, errs)
    assert isinstance(errs.get("n2"), NotGroupConsistent), (out, errs)   # its compare's cut, met by no one
    assert gens(span, "b") == gens(span, "a") == {"n1": 1, "n2": 1}
    assert round_state(PoolLayout(span["pools"]["b", "n1"]), GROUP)["prepared"] is None
    request_resync(span["pools"]["b", "n1"], GROUP)    # the group's resync, asked on every part
    out, errs = both(span)                       # n1's lock is free: both compare, and meet
    assert not errs, errs
    assert gens(span, "b") == {"n1": 2, "n2": 2}
    same(span)


def _kill_after_vote(span, node):
    """Run *node*'s part in its own process, SIGKILLed between its vote and the decision."""
    code = (f"import redis; from workers.client import RedisCut; from drsvc.replication import sync_unit; "
            f"from drsvc.transport.local import LocalPeer; "
            f"c = RedisCut(redis.Redis(port={span['port']}), 'a', {GROUP!r}, {node!r}, {list(NODES)!r}, freeze_wait=60); "
            f"sync_unit({str(span['pools']['a', node])!r}, {GROUP!r}, [{span['vols'][node]!r}], "
            f"LocalPeer({str(span['pools']['b', node])!r}), kind='group', cut=c)")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                            env=dict(os.environ, DRSVC_FAILPOINTS="sender.after_vote"))


def _crash_round(span):
    """A round in which n1 dies after voting: n2 applies it, n1's peer holds it prepared."""
    for n in NODES:
        write_at(span["pools"]["a", n] / "images" / f"{span['vols'][n]}.img", 2 * MiB, os.urandom(16384))
    proc = _kill_after_vote(span, "n1")
    # n2 waits for n1's process, which under load may take longer than the default 5 s to start
    part(span, "n2", cut=cut(span, "n2", freeze_wait=60))
    assert proc.wait(60) == -9
    assert gens(span, "b") == {"n1": 1, "n2": 2}
    prepared = round_state(PoolLayout(span["pools"]["b", "n1"]), GROUP)["prepared"]
    assert prepared is not None and prepared["target"] == 2
    return prepared


def test_a_part_killed_after_its_vote_settles_the_round_at_its_next_sync(span):
    assert not both(span)[1]
    _crash_round(span)
    # the next round: n1 settles (commit, as decided), adopts generation 2, then both cut 3
    out, errs = both(span)
    assert not errs, errs
    assert out["n1"].steps[:2] == ["settle", "finalize"], out["n1"].steps
    assert gens(span, "a") == gens(span, "b") == {"n1": 3, "n2": 3}
    same(span)


def test_the_peer_site_settles_a_round_left_prepared_before_it_promotes(span):
    """What ClusterReplication.promote does on the DR site's nodes (the origin may be gone):
    the round n2 applied is applied on n1 too."""
    assert not both(span)[1]
    prepared = _crash_round(span)
    states = {n: round_state(PoolLayout(span["pools"]["b", n]), GROUP) for n in NODES}
    assert settle_plan(states) == {"n1": True}
    assert settle_round(PoolLayout(span["pools"]["b", "n1"]), GROUP, prepared["txid"], True)["type"] == "committed"
    assert gens(span, "b") == {"n1": 2, "n2": 2}
    # and the other way round: a round no node applied is dropped everywhere
    states = {"n1": {"generation": 2, "prepared": {"txid": "t", "target": 3, "round": "r"}},
              "n2": {"generation": 2, "prepared": None}}
    assert settle_plan(states) == {"n1": False}


@pytest.mark.parametrize("point", ["receiver.after_prepare", "receiver.after_decide_marker"])
def test_a_receiver_killed_in_the_two_phase_commit_loses_nothing(span, point):
    """n1's receiver is SIGKILLed after its vote, or after it marked the decision committed:
    the round still ends the same on both nodes (applied by replay at the next contact, or
    settled by the next sync), and the next round is cut on both."""
    from drsvc.errors import DrsvcError
    assert not both(span)[1]
    for n in NODES:
        write_at(span["pools"]["a", n] / "images" / f"{span['vols'][n]}.img", MiB, os.urandom(12288))
    out, errs = {}, {}

    def run(n):
        env = {"DRSVC_FAILPOINTS": point} if n == "n1" else None
        try:
            out[n] = sync_unit(span["pools"]["a", n], GROUP, [span["vols"][n]],
                               LocalPeer(span["pools"]["b", n], name=f"b-{n}", env=env), kind="group",
                               cut=cut(span, n, vote_wait=20))
        except DrsvcError as e:
            errs[n] = e
    threads = [threading.Thread(target=run, args=(n,)) for n in NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "n1" in errs, out
    out, errs = both(span)
    assert not errs, errs
    assert gens(span, "a") == gens(span, "b")
    assert len(set(gens(span, "b").values())) == 1
    same(span)


def test_a_demotes_final_round_never_meets_a_scheduled_round(span):
    """A Demote's final round (every part with ``demote``) meets only the other parts'
    final rounds. Were it to meet a scheduled round of another part at the same generation,
    the round would commit with the demotion mark at one peer node only, and that part's
    own final round would then find no one to meet: the planned failover would end diverged
    (the multi-node failback CI saw: "the peer has not demoted n1.grp-… at generation 6")."""
    assert not both(span)[1]
    for n in NODES:
        write_at(span["pools"]["a", n] / "images" / f"{span['vols'][n]}.img", 2 * MiB, os.urandom(8192))
    errs = {}

    def run(n, demote):
        try:
            part(span, n, demote=demote, cut=cut(span, n, demote=demote, freeze_wait=1.0))
        except Exception as e:  # noqa: BLE001 - compared by the test
            errs[n] = e
    threads = [threading.Thread(target=run, args=("n1", True)), threading.Thread(target=run, args=("n2", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(errs.get("n1"), NotGroupConsistent), errs
    assert isinstance(errs.get("n2"), NotGroupConsistent), errs
    assert "a Demote of group" in str(errs["n2"]), errs      # it gave way, not timed out
    assert gens(span, "b") == {"n1": 1, "n2": 1}
    # the scheduled round gives way at once to a Demote being cut, and the final rounds meet
    out, errs = both(span, demote=True, freeze_wait=30)
    assert not errs, errs
    assert {n: find_state(span["pools"]["b", n], GROUP).peer_demoted_at for n in NODES} == {"n1": 2, "n2": 2}
