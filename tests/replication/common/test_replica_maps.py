"""The block maps a secondary keeps of its replica, and the promote that uses them.

A promote makes the received images the base of the new primary's first sync, with block
maps. The receiver keeps those maps as transactions apply (``replica_maps``), so the promote
reads no data. These tests check four things:
- the maps equal the images' digests after every kind of change;
- the promote's base is built from them;
- they are dropped the moment they stop describing the images;
- a Demote seeds them at the old primary, so a failback promote reads nothing either.
"""
import os
import random
import time

from drsvc import store
from drsvc.replication import sync_unit
from drsvc.replication.common import unit_state as rstate
from drsvc.layout import PoolLayout
from drsvc.replication.common import replica_maps as replicamap
from drsvc.replication.common.replica_maps import ReplicaMaps
from drsvc.replication.control.takeover import seed_base
from drsvc.transport.local import LocalPeer
from tests.fixtures.maps import image_map, map_slots, replica_maps

from ..conftest import make_image, new_sites, same_images, write_at

KiB, MiB = 1024, 1 << 20


def _base_meta(pool, unit):
    st = rstate.get_state(pool, unit)
    return store.read_doc(PoolLayout(pool).snap_dir(unit, st.generation) / "meta.json")


def _changes(img, rnd: random.Random, n=40):
    """Scattered 4 KiB rewrites, a zeroed run and a rewrite with the same bytes."""
    size = os.path.getsize(img)
    for _ in range(n):
        write_at(img, rnd.randrange(0, size // 4096) * 4096, rnd.randbytes(4096))
    write_at(img, 2 * MiB, bytes(256 * KiB))
    with open(img, "rb") as f:
        f.seek(MiB)
        same = f.read(64 * KiB)
    write_at(img, MiB, same)


def test_maps_follow_every_transaction_and_the_promote_reads_none(xfs_mod):
    a, b = new_sites(xfs_mod)
    rnd = random.Random(7)
    img = a / "images" / "v.img"
    make_image(img, 8 * MiB, [(0, rnd.randbytes(6 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    assert replica_maps(b, "v") == "exact"              # a new member's map, built whole
    for _ in range(3):
        _changes(img, rnd)
        sync_unit(a, "v", ["v"], peer)
        assert replica_maps(b, "v") == "exact"
    os.truncate(img, 12 * MiB)                          # growth is part of a transaction
    write_at(img, 11 * MiB, rnd.randbytes(8 * KiB))
    sync_unit(a, "v", ["v"], peer)
    assert replica_maps(b, "v") == "exact"

    sync_unit(a, "v", ["v"], peer, demote=True)      # nothing new: the demotion mark
    assert replica_maps(b, "v") == "exact"

    assert seed_base(b, "v")
    meta = _base_meta(b, "v")
    assert meta["seeded_from"] == "replica maps" and meta["scanned"] == 0
    base = PoolLayout(b).snap_dir("v", meta["generation"])
    size, slots = map_slots(base / "v.map")
    assert size == 12 * MiB and slots == image_map(b / "images" / "v.img", 4096)

    # b takes over and writes: its first sync ships only what it wrote
    rstate.promote(b, "v")
    ReplicaMaps(PoolLayout(b), "v").discard()
    write_at(b / "images" / "v.img", 3 * MiB, rnd.randbytes(12 * KiB))
    r = sync_unit(b, "v", ["v"], LocalPeer(a))
    assert r.bytes_changed == 12 * KiB and r.base_generation == meta["generation"]
    same_images(b, a, ["v"])


def test_maps_unused_once_an_image_changes_behind_the_receiver(xfs_mod):
    """A write the receiver did not make (here, straight into the replica) leaves the maps
    unused, and the promote falls back to planning the base from the images."""
    a, b = new_sites(xfs_mod)
    rnd = random.Random(8)
    img = a / "images" / "v.img"
    make_image(img, 4 * MiB, [(0, rnd.randbytes(3 * MiB))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    assert replica_maps(b, "v") == "exact"
    time.sleep(0.02)      # past the coarse clock's tick, as any later write is
    write_at(b / "images" / "v.img", 0, rnd.randbytes(4096))
    assert replica_maps(b, "v") == "unused"
    assert seed_base(b, "v")
    meta = _base_meta(b, "v")
    assert "seeded_from" not in meta and meta["scanned"] > 0
    _, slots = map_slots(PoolLayout(b).snap_dir("v", meta["generation"]) / "v.map")
    assert slots == image_map(b / "images" / "v.img", 4096)


def test_a_demote_seeds_the_old_primarys_maps(xfs_mod):
    """After a planned failover the old primary receives; its maps come from the final
    sync's acked snapshot, so promoting it back (failback) reads no data either."""
    a, b = new_sites(xfs_mod)
    rnd = random.Random(9)
    img = a / "images" / "v.img"
    make_image(img, 6 * MiB, [(0, rnd.randbytes(5 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    _changes(img, rnd)
    # the app stopped and its volume was unstaged a moment before the Demote: the last
    # write is older than the final capture by more than the kernel clock's tick
    time.sleep(0.1)
    sync_unit(a, "v", ["v"], peer, demote=True)
    assert replica_maps(a, "v") == "exact"

    assert seed_base(b, "v")
    rstate.promote(b, "v")
    ReplicaMaps(PoolLayout(b), "v").discard()
    _changes(b / "images" / "v.img", rnd)
    time.sleep(0.1)
    sync_unit(b, "v", ["v"], LocalPeer(a), demote=True)
    assert replica_maps(a, "v") == "exact"       # it followed b's transactions
    assert replica_maps(b, "v") == "exact"       # and b's demote seeded its own

    assert seed_base(a, "v")
    assert _base_meta(a, "v")["seeded_from"] == "replica maps"


def test_a_demote_right_after_a_write_does_not_seed(xfs_mod, monkeypatch):
    """A write as recent as the final capture may have landed after it: no seed. (The
    slack is widened so that a loaded machine, slow between the write and the capture,
    cannot make the write look older than it.)"""
    monkeypatch.setattr(replicamap, "CAPTURE_SLACK_NS", 60_000_000_000)
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 2 * MiB, [(0, os.urandom(MiB))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    write_at(img, 0, os.urandom(4096))
    sync_unit(a, "v", ["v"], LocalPeer(b), demote=True)
    assert replica_maps(a, "v") == "unused"


def test_unsynced_maps_count_only_in_the_boot_that_wrote_them(xfs_mod, monkeypatch):
    """The maps are not fsynced on a sync's path (only every DURABLE_EVERY s, and by the
    promote that uses them): after a reboot, unsynced ones are not trusted."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 2 * MiB, [(0, os.urandom(MiB))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    doc = store.read_doc(PoolLayout(b).replica_maps_doc("v"))
    assert doc["durable"]                             # the first one is
    write_at(img, 0, os.urandom(8192))
    sync_unit(a, "v", ["v"], LocalPeer(b))
    doc = store.read_doc(PoolLayout(b).replica_maps_doc("v"))
    assert not doc["durable"] and doc["boot"] == replicamap.boot_id()
    assert replica_maps(b, "v") == "exact"
    monkeypatch.setattr(replicamap, "boot_id", lambda: "a-later-boot")
    assert replica_maps(b, "v") == "unused"
    assert seed_base(b, "v") == "images"


def test_maps_that_cannot_be_written_never_fail_a_transaction(xfs_mod):
    """The maps are an optimisation: when they cannot be written (here a map that is not a
    file; on a full pool, ENOSPC), the transaction commits and the maps are left unused."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 2 * MiB, [(0, os.urandom(MiB))])
    sync_unit(a, "v", ["v"], LocalPeer(b))
    mp = PoolLayout(b).replica_map("v", "v")
    mp.unlink()
    mp.mkdir()
    write_at(img, 0, os.urandom(8192))
    r = sync_unit(a, "v", ["v"], LocalPeer(b))
    assert r.target_generation == 2
    same_images(a, b, ["v"])
    assert replica_maps(b, "v") == "unused"
    assert seed_base(b, "v") == "images"
