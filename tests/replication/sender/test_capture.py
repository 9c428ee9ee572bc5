"""The two-pass overlay capture: writes that land between the pre-copy (unfrozen) and
the frozen pass are in the generation, and only they are cloned again inside the freeze.

The writes are injected right after the real pre-copy (the seam between the two
passes); everything else is the real engine on a loop-mounted XFS, and the replica is
compared byte for byte with the image as it stood at the frozen pass. Over a slow link
(a stated ``link_rate``) the records leave while the pre-copy clones (``capture_feed``): the
ranges written after their clone are then planned a second time, after the first records."""
import os
import random
import threading

import pytest

from drsvc.replication.sender import capture as capture_mod
from drsvc.replication.sender import capture_feed
from drsvc.replication import sync_unit
from drsvc.replication.common.blockmap import punch_hole
from drsvc.transport import LinkHints
from drsvc.transport.local import LocalPeer
from drsvc_lab import wait_until
from tests.fixtures.xfs import need

from ..conftest import make_image, new_sites, same_images, write_at

BS = 4096
SIZE = 24 << 20


def _tick_after(path) -> bool:
    """Whether the filesystem's (coarse) clock has moved past *path*'s last change."""
    probe = path.parents[2] / "tick"          # beside the pools, on the same filesystem
    probe.touch()
    return os.stat(probe).st_ctime_ns > os.stat(path).st_ctime_ns


@pytest.mark.parametrize("early", [False, True], ids=["planned-after", "records-while-cloning"])
def test_writes_between_precopy_and_freeze_are_in_the_generation(xfs_mod, monkeypatch, early):
    need("mkfs.xfs")
    # a rate at which the change is link-bound (prepare._wire_bound): the plan follows the clones
    link = LinkHints(rate=64 << 10) if early else None
    rnd = random.Random(23)
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, SIZE, [(0, rnd.randbytes(SIZE))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)

    blocks = rnd.sample(range(0, SIZE // BS, 2), 60)         # non-adjacent: one range each
    before, during = blocks[:40], blocks[40:]
    for blk in before:
        write_at(img, blk * BS, rnd.randbytes(BS))
    rewritten = before[:5]          # changed before the capture, and again between the passes
    punched = during[-1]            # data in the base, a hole by the frozen pass

    real = capture_mod._precopy_all
    seen = {}

    first_pass = threading.Event()
    real_scan = capture_feed.scan_member

    def scan(*args):
        real_scan(*args)
        if args[3] is not args[4]:      # against the base map, not the new one: the first pass
            first_pass.set()
    monkeypatch.setattr(capture_feed, "scan_member", scan)

    def precopy_then_write(*args):
        got = real(*args)
        seen["precopied"] = got[0]["v"].cloned
        if early:       # the first records were planned from the clones before these writes
            assert first_pass.wait(30)
        for blk in rewritten + during[:-1]:
            write_at(img, blk * BS, rnd.randbytes(BS))
        fd = os.open(img, os.O_RDWR)
        try:
            punch_hole(fd, punched * BS, BS)
            os.fsync(fd)
        finally:
            os.close(fd)
        # past the clock tick of the last write: the overlay stands
        wait_until(lambda: _tick_after(img), 5, "the filesystem's clock to pass the last write")
        return got
    monkeypatch.setattr(capture_mod, "_precopy_all", precopy_then_write)

    rep = sync_unit(a, "v", ["v"], peer, link=link)
    same_images(a, b, ["v"])        # the replica is the image as the frozen pass saw it
    assert seen["precopied"] == len(before)
    # inside the freeze, only what moved since the pre-copy was cloned again
    assert rep.ranges_cloned == len(before) + len(rewritten) + len(during) - 1
    assert "precopy_s" in rep.phases and "freeze_s" in rep.phases
    assert rep.early is early
    if early:
        # the first pass sent what the clones held; the ranges written after their clone went
        # again, later in the plan (the punched block as a zero record)
        assert rep.bytes_changed == (len(before) + len(rewritten) + len(during) - 1) * BS
        assert rep.bytes_zeroed == BS and rep.stripes == 1
    else:
        assert rep.bytes_changed == (len(before) + len(during) - 1) * BS

    monkeypatch.setattr(capture_mod, "_precopy_all", real)
    for blk in during:              # and the next generation starts from that one
        write_at(img, blk * BS, rnd.randbytes(BS))
    rep = sync_unit(a, "v", ["v"], peer, link=link)
    same_images(a, b, ["v"])
    assert rep.ranges_cloned == len(during) and rep.early is early
    assert rep.bytes_changed == len(during) * BS


def test_an_image_written_after_the_frozen_map_goes_again_whole(xfs_mod, monkeypatch):
    """Nothing to freeze (no mountpoint) and a write after the frozen pass's map: the image
    is captured whole. With records already sent from its overlay (an early plan), the whole
    image is cloned over that overlay in one FICLONERANGE, and the plan's second pass covers
    every range that differs from the base, against what the first pass planned: the replica
    ends as the image stood at that clone, including a block written back to its base bytes."""
    need("mkfs.xfs")
    rnd = random.Random(29)
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    base_bytes = rnd.randbytes(SIZE)
    make_image(img, SIZE, [(0, base_bytes)])
    peer = LocalPeer(b)
    link = LinkHints(rate=64 << 10)
    sync_unit(a, "v", ["v"], peer, link=link)

    blocks = rnd.sample(range(0, SIZE // BS, 2), 30)
    for blk in blocks:
        write_at(img, blk * BS, rnd.randbytes(BS))
    late = rnd.sample(range(1, SIZE // BS, 2), 5)       # written after the frozen pass's map
    restored = blocks[0]                                # and one changed block back to its base bytes
    real = capture_mod._recapture_written

    def write_then_check(*args, **kw):
        for blk in late:
            write_at(img, blk * BS, rnd.randbytes(BS))
        write_at(img, restored * BS, base_bytes[restored * BS:(restored + 1) * BS])
        wait_until(lambda: _tick_after(img), 5, "the filesystem's clock to pass the last write")
        return real(*args, **kw)
    monkeypatch.setattr(capture_mod, "_recapture_written", write_then_check)

    rep = sync_unit(a, "v", ["v"], peer, link=link)
    same_images(a, b, ["v"])
    assert rep.early and rep.stripes == 1
    monkeypatch.setattr(capture_mod, "_recapture_written", real)
    write_at(img, blocks[1] * BS, rnd.randbytes(BS))    # and the next generation starts from that one
    rep = sync_unit(a, "v", ["v"], peer, link=link)
    same_images(a, b, ["v"])
    assert rep.bytes_changed == BS
