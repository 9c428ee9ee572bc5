"""End-to-end correctness: after every sync the replica equals the primary's snapshot.

Pools live on loop-mounted XFS (reflink + FIEMAP) and, for the fallback path,
on a filesystem without reflink. The peer is a real receiver process (local
transport), or the real sshd for the SSH cases."""
import os
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drsvc import store
from drsvc.errors import (NotPrimary, OperationInProgress, ReplicaIsPrimary, ReplicationConflict,
                          StaleEpoch)
from drsvc.replication import peer_status, release_peer, sync_unit, verify_unit
from drsvc.replication.common import unit_state as rstate
from drsvc.layout import PoolLayout
from drsvc.replication.sender.receiver_client import ApplySession
from drsvc.transport.local import LocalPeer
from tests.fixtures.maps import replica_maps
from tests.fixtures.xfs import need

from ..conftest import make_image, new_sites, same_images, sha, write_at

KiB, MiB = 1024, 1 << 20

op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 6 * MiB), st.integers(1, 300 * KiB)),
    st.tuples(st.just("zero"), st.integers(0, 6 * MiB), st.integers(1, 300 * KiB)),
    st.tuples(st.just("punch"), st.integers(0, 6 * MiB), st.integers(1, 600 * KiB)),
    st.tuples(st.just("same"), st.integers(0, 6 * MiB), st.integers(1, 64 * KiB)),
    st.tuples(st.just("grow"), st.integers(0, 2 * MiB), st.just(0)),
)


def apply_op(path, o, rnd: random.Random):
    kind, off, n = o
    size = os.path.getsize(path)
    if kind == "grow":
        os.truncate(path, size + off)
        return
    off = off % max(size, 1)
    n = min(n, size - off) if kind != "write" else n
    if n <= 0:
        return
    if kind == "write":
        write_at(path, off, rnd.randbytes(n))
    elif kind == "zero":
        write_at(path, off, bytes(n))
    elif kind == "same":   # rewrite identical bytes: new extents, same content
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read(n)
        write_at(path, off, data)
    else:
        from drsvc.replication.common.blockmap import punch_hole
        fd = os.open(path, os.O_RDWR)
        try:
            punch_hole(fd, off, n)
        finally:
            os.close(fd)


@pytest.fixture(params=["xfs", "noreflink"])
def fsroot(request, xfs_mod, tmp_path):
    if request.param == "xfs":
        need("mkfs.xfs")
        return xfs_mod
    return tmp_path


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(bs=st.sampled_from([512, 4096, 65536]), nvols=st.integers(1, 3),
       rounds=st.lists(st.lists(op, min_size=1, max_size=6), min_size=1, max_size=3),
       add_member=st.booleans(), seed=st.integers(0, 2**32))
def test_replica_equals_snapshot_after_every_sync(fsroot, bs, nvols, rounds, add_member, seed):
    rnd = random.Random(seed)
    a, b = new_sites(fsroot)
    vols = [f"v{i}" for i in range(nvols)]
    for v in vols:
        make_image(a / "images" / f"{v}.img", 4 * MiB + rnd.randrange(0, 3) * 4096 + rnd.choice([0, 100]),
                   [(rnd.randrange(0, 4 * MiB), rnd.randbytes(rnd.randrange(1, 200 * KiB))),
                    (rnd.randrange(0, 4 * MiB), bytes(64 * KiB))])
    unit = "grp" if nvols > 1 else vols[0]
    peer = LocalPeer(b)
    r = sync_unit(a, unit, vols, peer, block_size=bs)
    same_images(a, b, vols)
    assert r.target_generation == 1
    for i, ops in enumerate(rounds):
        if add_member and i == len(rounds) - 1:
            vols = vols + ["extra"]
            make_image(a / "images" / "extra.img", MiB, [(4096, rnd.randbytes(10000))])
            unit_vols = vols
        else:
            unit_vols = vols
        for o in ops:
            apply_op(a / "images" / f"{rnd.choice(vols)}.img", o, rnd)
        r = sync_unit(a, unit, unit_vols, peer)
        same_images(a, b, unit_vols)
        assert replica_maps(b, unit) == "exact"
        snap = PoolLayout(a).snap_dir(unit, r.target_generation)
        for v in unit_vols:
            assert sha(snap / f"{v}.img") == sha(b / "images" / f"{v}.img")
        assert r.target_generation == i + 2 and r.base_generation == i + 1
    assert peer_status(peer, unit)["generation"] == len(rounds) + 1
    assert verify_unit(a, unit, peer).ok


def test_rewrite_with_identical_data_ships_nothing(xfs_mod):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    data = os.urandom(2 * MiB)
    make_image(img, 16 * MiB, [(MiB, data)])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    write_at(img, MiB, data)          # new extents, same bytes
    r = sync_unit(a, "v", ["v"], peer)
    assert r.reflink and r.bytes_scanned >= 2 * MiB
    assert r.records == 0 and r.bytes_changed == 0
    same_images(a, b, ["v"])


def test_fiemap_limits_scanning_to_changed_extents(xfs_mod):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 64 * MiB, [(0, os.urandom(32 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    offs = random.Random(1).sample(range(0, 32 * MiB, 4096), 40)
    for off in offs:
        write_at(img, off, os.urandom(4096))
    r = sync_unit(a, "v", ["v"], peer)
    assert r.reflink
    assert r.bytes_changed == 40 * 4096 and r.bytes_scanned == 40 * 4096
    assert r.bytes_on_wire < 40 * 4096 * 1.05 + 4096
    same_images(a, b, ["v"])


def test_zero_blocks_travel_as_ranges_and_are_punched(xfs_mod):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 16 * MiB, [(0, os.urandom(8 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    write_at(img, MiB, bytes(4 * MiB))
    r = sync_unit(a, "v", ["v"], peer)
    assert r.bytes_zeroed == 4 * MiB and r.bytes_changed == 0 and r.bytes_on_wire < 4096
    same_images(a, b, ["v"])
    from drsvc.host.reflink import data_ranges
    fd = os.open(b / "images" / "v.img", os.O_RDONLY)
    try:
        ranges = list(data_ranges(fd, 16 * MiB))
    finally:
        os.close(fd)
    assert sum(n for _, n in ranges) == 4 * MiB   # the zeroed 4 MiB is a hole at the peer


def test_thin_image_reads_only_data(xfs_mod):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "thin.img"
    make_image(img, 8 << 30, [(3 << 30, os.urandom(MiB))])
    r = sync_unit(a, "thin", ["thin"], LocalPeer(b))
    assert r.bytes_scanned == MiB and r.bytes_changed == MiB
    same_images(a, b, ["thin"])


def test_compressible_data_is_compressed(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", 8 * MiB, [(0, b"hello world, " * 300000)])
    r = sync_unit(a, "v", ["v"], LocalPeer(b))
    assert r.bytes_on_wire < r.bytes_changed / 4
    same_images(a, b, ["v"])


def test_bandwidth_limit(xfs_mod):
    import time
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", 8 * MiB, [(0, os.urandom(3 * MiB))])
    t = time.monotonic()
    r = sync_unit(a, "v", ["v"], LocalPeer(b), bwlimit=2 * MiB)
    # 3 MiB at 2 MiB/s with one second of burst needs at least ~0.5 s of waiting
    assert time.monotonic() - t >= 0.4
    same_images(a, b, ["v"])
    assert r.bytes_on_wire >= 3 * MiB


def test_fencing_roles_and_demotion(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", MiB, [(0, os.urandom(10000))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer, epoch=3)
    assert peer_status(peer, "v")["epoch"] == 3
    # a stale primary (older epoch) is fenced
    rstate.ensure_unit(b, "v", ["v"])
    with pytest.raises(StaleEpoch):
        sync_unit(a, "v", ["v"], peer, epoch=2)
    # the peer was promoted: deltas to it are refused
    rstate.set_role(b, "v", "primary")
    with pytest.raises(ReplicaIsPrimary):
        sync_unit(a, "v", ["v"], peer)
    rstate.set_role(b, "v", "secondary")
    # planned failover: the final delta carries the demotion mark
    write_at(a / "images" / "v.img", 0, b"final")
    r = sync_unit(a, "v", ["v"], peer, demote=True)
    assert peer_status(peer, "v")["peer_demoted_at"] == r.target_generation
    st = rstate.get_state(a, "v")
    assert st.role == "secondary" and st.demoted and st.demoted_at == r.target_generation
    with pytest.raises(NotPrimary):
        sync_unit(a, "v", ["v"], peer)
    # forced promotion on the peer bumps its epoch; the old primary, promoted again
    # without a new epoch, is fenced
    rstate.set_role(a, "v", "primary")
    rstate.bump_epoch(b, "v")
    with pytest.raises(StaleEpoch):
        sync_unit(a, "v", ["v"], peer)
    same_images(a, b, ["v"])


def test_two_primaries_syncing_to_each_other_are_told_at_once(xfs_mod):
    """Split brain with both sites syncing on the same schedule: each primary's sync holds its
    own unit lock while it talks to the other, whose receiver found that lock taken. The
    receiver of a site that is primary refuses at once (ReplicaIsPrimary: the sender
    reports the conflict) instead of waiting out LOCK_WAIT for a lock its own sync holds, and
    answering OperationInProgress, at every interval, with the conflict never reported."""
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", MiB, [(0, os.urandom(10000))])
    make_image(b / "images" / "v.img", MiB)
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    rstate.set_role(b, "v", "primary")              # b taken over by force; a still primary
    rstate.bump_epoch(b, "v")
    write_at(a / "images" / "v.img", 0, b"after the takeover")
    layout = PoolLayout(b)
    with store.file_lock(layout.lock_path("v"), blocking=False, key="v"):   # b's own sync, under way
        with pytest.raises(ReplicaIsPrimary):
            sync_unit(a, "v", ["v"], peer)
        with pytest.raises(ReplicaIsPrimary):
            peer_status(peer, "v")
    # a secondary's receiver still waits for its lock (a receiver of a dropped connection
    # may be exiting): with the lock free the same sync is refused by the state
    with pytest.raises(ReplicaIsPrimary):
        sync_unit(a, "v", ["v"], peer)


def test_compare_mode_resyncs_only_differing_blocks(xfs_mod):
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 32 * MiB, [(0, os.urandom(16 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    # split brain: both sides wrote (the replica was promoted for a while)
    write_at(img, 0, os.urandom(8192))
    write_at(b / "images" / "v.img", 5 * MiB, os.urandom(4096))
    write_at(b / "images" / "v.img", 20 * MiB, os.urandom(4096))
    st = rstate.get_state(b, "v")
    st.generation += 5      # the peer moved on in its own history
    rstate.save_state(b, st)
    with pytest.raises(ReplicationConflict):
        sync_unit(a, "v", ["v"], peer)
    r = sync_unit(a, "v", ["v"], peer, mode="compare")
    assert r.bytes_changed == 3 * 4096 and r.bytes_zeroed == 4096
    same_images(a, b, ["v"])
    assert rstate.get_state(a, "v").generation == peer_status(peer, "v")["generation"]
    r = sync_unit(a, "v", ["v"], peer)        # back to plain deltas
    assert r.records == 0


def test_wrong_base_is_refused_and_replica_intact(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", MiB, [(0, os.urandom(50000))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    before = sha(b / "images" / "v.img")
    # forge the sender's idea of the acked generation
    st = rstate.get_state(a, "v")
    snapd = PoolLayout(a).snap_dir("v", st.generation)
    snapd.rename(snapd.with_name("7"))
    st.generation = 7
    rstate.save_state(a, st)
    write_at(a / "images" / "v.img", 0, os.urandom(4096))
    with pytest.raises(ReplicationConflict):
        sync_unit(a, "v", ["v"], peer)
    assert sha(b / "images" / "v.img") == before


def test_release(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", MiB, [(0, b"x" * 5000)])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    assert release_peer(peer, "v")["existed"]
    assert (b / "images" / "v.img").exists() and not (b / "replication" / "v").exists()
    sync_unit_fresh = sync_unit  # the relationship is gone: the sender must start over
    with pytest.raises(ReplicationConflict):
        sync_unit_fresh(a, "v", ["v"], peer)
    from drsvc.replication import release_unit
    assert release_unit(a, "v")
    r = sync_unit(a, "v", ["v"], peer)
    assert r.target_generation == 1
    assert release_peer(peer, "v", delete_image=True)["removed_images"] == ["v"]
    assert not (b / "images" / "v.img").exists()


def test_sync_over_ssh_group(xfs_mod, sshd_factory):
    need("mkfs.xfs")
    a, b = new_sites(xfs_mod)
    site = sshd_factory(b)
    peer = site.peer()
    for v in ("g1", "g2"):
        make_image(a / "images" / f"{v}.img", 8 * MiB, [(MiB, os.urandom(2 * MiB))])
    r = sync_unit(a, "grp", ["g1", "g2"], peer)
    assert r.target_generation == 1
    write_at(a / "images" / "g2.img", 3 * MiB, os.urandom(4096))
    os.truncate(a / "images" / "g1.img", 12 * MiB)
    r = sync_unit(a, "grp", ["g1", "g2"], peer)
    assert r.bytes_changed == 4096 and peer.cipher == "aes128-gcm@openssh.com"
    same_images(a, b, ["g1", "g2"])
    assert verify_unit(a, "grp", peer).ok
    st = peer_status(peer, "grp")
    assert st["kind"] == "group" and st["members"] == ["g1", "g2"] and st["generation"] == 2


def test_verify_names_differing_ranges(xfs_mod):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", 8 * MiB, [(0, os.urandom(4 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    write_at(b / "images" / "v.img", 2 * MiB + 10, b"bitrot")
    rep = verify_unit(a, "v", peer)
    assert not rep.ok and rep.members["v"]["differs"] == [[2 * MiB, 4096]]


def _unit_free(pool, unit_id: str, within: float = 0.0) -> bool:
    """The unit's lock at *pool* can be taken (now, or within *within* seconds)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with store.file_lock(PoolLayout(pool).lock_path(unit_id), blocking=False, key=unit_id):
                return True
        except OperationInProgress:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def test_a_demotes_final_commit_frees_the_unit_before_the_senders_bye(xfs_mod, monkeypatch):
    """The receiver holds the unit's lock through an apply conversation, to its ``bye``. After
    a Demote's final transaction commits, nothing but the ``bye`` can come, and it comes half
    a round trip later, after the sender's adopt: the receiver lets the lock go with its
    ``committed``, so the Promote the CO sends next does not wait for it. The sender's
    ``bye`` is held back here (its session's close) while the lock at b is tried."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 8 * MiB, [(0, os.urandom(MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    seen = []
    close = ApplySession.close

    def held_bye(session):
        seen.append(_unit_free(b, "v", within=10.0 if demoting else 0.0))
        close(session)
    monkeypatch.setattr(ApplySession, "close", held_bye)
    demoting = False
    write_at(img, 0, os.urandom(8192))
    sync_unit(a, "v", ["v"], peer)                 # a scheduled sync: held to its bye
    assert seen == [False]
    demoting = True
    write_at(img, 4 * MiB, os.urandom(8192))
    r = sync_unit(a, "v", ["v"], peer, demote=True)
    assert seen == [False, True], seen
    assert rstate.get_state(b, "v").peer_demoted_at == r.target_generation
    assert sha(b / "images" / "v.img") == sha(img)
