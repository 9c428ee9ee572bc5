"""Capture and plan on an aged (fragmented) image: correct, and their work follows
the change, not the image's extent count.

The image is aged by rounds of scattered 4 KiB rewrites, each synced, as a live
volume ages; the checks count work (ranges cloned by the overlay capture, bytes
hashed by the plan), never time."""
import os
import random

from drsvc.host.fiemap import fiemap_array
from drsvc.replication import sync_unit
from drsvc.transport.local import LocalPeer
from tests.fixtures.xfs import need

from ..conftest import make_image, new_sites, same_images, write_at

BS = 4096
SIZE = 24 << 20


def extent_count(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return len(fiemap_array(fd, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def small_change(path, rnd, blocks: int = 6) -> set:
    """Rewrite *blocks* scattered, non-adjacent blocks; return their indexes."""
    picked = set()
    while len(picked) < blocks:
        b = rnd.randrange(1, SIZE // BS - 1, 2)
        if not {b - 1, b, b + 1} & picked:
            picked.add(b)
    for b in picked:
        write_at(path, b * BS, rnd.randbytes(BS))
    return picked


def test_capture_work_follows_the_change_on_an_aged_image(xfs_mod):
    need("mkfs.xfs")
    rnd = random.Random(11)
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, SIZE, [(0, rnd.randbytes(SIZE))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)

    def timed_small_sync():
        small_change(img, rnd)
        rep = sync_unit(a, "v", ["v"], peer)
        same_images(a, b, ["v"])          # byte comparison with the replica
        return rep

    young = timed_small_sync()
    young_extents = extent_count(img)
    for _ in range(25):                   # age: 1% scattered rewrites, each synced
        for blk in rnd.sample(range(SIZE // BS), SIZE // BS // 100):
            write_at(img, blk * BS, rnd.randbytes(BS))
        sync_unit(a, "v", ["v"], peer)
        same_images(a, b, ["v"])
    aged_extents = extent_count(img)
    assert aged_extents > 10 * young_extents and aged_extents > 500, (young_extents, aged_extents)
    aged = timed_small_sync()
    for rep in (young, aged):
        assert rep.reflink and rep.steps == ["sync"]
        assert rep.bytes_changed == 6 * BS
        assert rep.bytes_scanned == 6 * BS        # hashed: the changed blocks, nothing else
        assert rep.ranges_cloned == 6             # cloned: one range per changed block
    assert aged.records == young.records == 6


def test_cached_base_extents_plan_like_a_fresh_fiemap(xfs_mod):
    """The extent map kept at an overlay capture stands for the rolled base: planning a
    new change against it gives exactly the ranges a fresh FIEMAP of the base gives.
    A torn or resized cache is refused (the capture maps the base again)."""
    need("mkfs.xfs")
    from drsvc.replication.common import ranges
    from drsvc.replication.sender import changes
    from drsvc.replication.sender.capture import extents_path, load_extents
    from drsvc.layout import PoolLayout
    from drsvc.replication.common.unit_state import find_state

    rnd = random.Random(5)
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, SIZE, [(0, rnd.randbytes(SIZE))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    for _ in range(4):
        for blk in rnd.sample(range(SIZE // BS), 300):
            write_at(img, blk * BS, rnd.randbytes(BS) if blk % 5 else bytes(BS))
        sync_unit(a, "v", ["v"], peer)
    st = find_state(a, "v")
    base = PoolLayout(a).snap_dir("v", st.generation) / "v.img"
    cached = load_extents(extents_path(base), SIZE)
    assert cached is not None and len(cached) > 300
    small_change(img, rnd)
    fd, bfd = os.open(img, os.O_RDONLY), os.open(base, os.O_RDONLY)
    try:
        live, fresh = fiemap_array(fd, SIZE), fiemap_array(bfd, SIZE)
    finally:
        os.close(fd)
        os.close(bfd)
    with_cache = changes.plan_from_extent_arrays(live, cached, SIZE, SIZE, BS)
    with_fiemap = changes.plan_from_extent_arrays(live, fresh, SIZE, SIZE, BS)
    assert with_cache.scan == with_fiemap.scan and with_cache.clear == with_fiemap.clear
    assert ranges.total(ranges.from_pairs(with_cache.scan)) == 6 * BS
    raw = bytearray(extents_path(base).read_bytes())
    assert load_extents(extents_path(base), SIZE + BS) is None          # another size
    raw[len(raw) // 2] ^= 0xFF
    extents_path(base).write_bytes(bytes(raw))
    assert load_extents(extents_path(base), SIZE) is None               # torn / corrupt
    rep = sync_unit(a, "v", ["v"], peer)                                 # maps the base again
    same_images(a, b, ["v"])
    assert rep.bytes_scanned == 6 * BS and rep.ranges_cloned == 6
