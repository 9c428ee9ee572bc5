"""Recovery points made by the real receiver on loop XFS: every kept point rebuilds to the
exact bytes the primary shipped at its generation, whatever the grid pruned in between,
and the points take only the bytes later generations overwrote."""
from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest

from drsvc.host.fiemap import fiemap_array
from drsvc.replication.receiver import commit_points
from drsvc.replication.points import undo_log
from drsvc.replication import sync_unit
from drsvc.layout import PoolLayout
from drsvc.replication.points.index import Index, build_image, listing, read_meta, select, undo_map
from drsvc.replication.receiver.undo_copy import UndoAhead
from drsvc.transport.local import LocalPeer

from ..conftest import make_image, new_sites, sha, write_at

KiB, MiB = 1024, 1 << 20


def origin(grid: str, snapshots=None) -> dict:
    o = {"site": "a", "interval": 60, "kind": "volume", "volumes": {}, "retention": grid}
    if snapshots is not None:
        o["snapshots"] = snapshots
    return o


def mutate(path, rnd: random.Random) -> None:
    """Small random writes, a large aligned write, a zeroed range, sometimes growth."""
    size = os.path.getsize(path)
    for _ in range(rnd.randint(1, 12)):
        write_at(path, rnd.randrange(0, size - 4 * KiB, 4096), rnd.randbytes(4096))
    off = rnd.randrange(0, size - 512 * KiB, 64 * KiB)
    write_at(path, off, rnd.randbytes(rnd.choice([64, 128, 256]) * KiB))
    write_at(path, rnd.randrange(0, size - 64 * KiB), bytes(rnd.randrange(1, 64 * KiB)))
    if rnd.random() < 0.2:
        os.truncate(path, size + MiB)


class Unit:
    """One primary pool, one replica pool, one unit; the sha of every generation shipped."""

    def __init__(self, root, vols=("v",), seed=0, size=4 * MiB):
        self.a, self.b = new_sites(root)
        self.vols = list(vols)
        self.unit = self.vols[0] if len(self.vols) == 1 else "grp"
        self.rnd = random.Random(seed)
        for v in self.vols:
            make_image(self.a / "images" / f"{v}.img", size, [(0, self.rnd.randbytes(size // 2))])
        self.peer = LocalPeer(self.b)
        self.shas: dict[int, dict] = {}
        self.layout = PoolLayout(self.b)

    def sync(self, grid="1x1000w(keep=all)", **origin_kw) -> int:
        r = sync_unit(self.a, self.unit, self.vols, self.peer, origin=origin(grid, **origin_kw))
        snap = PoolLayout(self.a).snap_dir(self.unit, r.target_generation)
        self.shas[r.target_generation] = {v: sha(snap / f"{v}.img") for v in self.vols}
        return r.target_generation

    def change(self):
        for v in self.vols:
            mutate(self.a / "images" / f"{v}.img", self.rnd)

    def index(self) -> Index:
        return Index.find(self.layout, self.unit)

    def check_all(self) -> list[int]:
        """Every kept point rebuilds to its generation's bytes; returns the kept generations."""
        idx = self.index()
        for p in idx.points:
            for v in self.vols:
                out = self.b / f"check-{v}.img"
                build_image(self.layout, idx, p, v, out)
                assert sha(out) == self.shas[p.generation][v], f"point {p.generation} of {v}"
                out.unlink()
        return [p.generation for p in idx.points]


def test_every_generation_is_a_point_that_rebuilds_exactly(xfs_mod):
    u = Unit(xfs_mod, vols=("v1", "v2", "v3"), seed=1)
    for _ in range(8):
        u.sync()
        u.change()
    u.sync()
    assert u.check_all() == list(range(1, 10))
    idx = u.index()
    assert idx.grid == "1x1000w(keep=all)"
    assert idx.points[-1].cut["members"] == ["v1", "v2", "v3"]
    assert len({p.txid for p in idx.points}) == 9


def test_pruning_folds_bytes_into_the_older_points_kept(xfs_mod):
    u = Unit(xfs_mod, seed=2)
    for _ in range(6):
        u.sync()
        u.change()
    u.sync()                                          # 7 points, all kept
    u.change()
    gen = u.sync("1x1000w(keep=2)")                   # the 2 oldest and the newest stay
    assert u.check_all() == [1, 2, gen]
    for _ in range(4):                                # from now on each sync drops the one before
        u.change()
        gen = u.sync("1x1000w(keep=2)")
        assert u.check_all() == [1, 2, gen]
    root = u.layout.points_dir(u.unit)
    assert sorted(int(d.name) for d in root.iterdir() if d.is_dir()) == [1, 2]   # the newest is the replica


def test_grid_none_keeps_only_the_replica_and_copies_nothing(xfs_mod):
    u = Unit(xfs_mod, seed=3)
    for _ in range(4):
        u.sync("none")
        u.change()
    gen = u.sync("none")
    assert u.check_all() == [gen]
    root = u.layout.points_dir(u.unit)
    assert not [d for d in root.iterdir() if d.is_dir()]


def test_unique_bytes_are_the_overwritten_bytes_and_add_up(xfs_mod):
    """A point keeps exactly what the next generation overwrote: 40 blocks of 4 KiB here,
    and the undo files hold no more than the points' unique bytes say."""
    a, b = new_sites(xfs_mod)
    img = a / "images" / "v.img"
    make_image(img, 16 * MiB, [(0, os.urandom(16 * MiB))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer, origin=origin("1x1000w(keep=all)"))
    offs = random.Random(4).sample(range(0, 16 * MiB, 4096), 40)
    for off in offs:
        write_at(img, off, os.urandom(4096))
    sync_unit(a, "v", ["v"], peer, origin=origin("1x1000w(keep=all)"))
    layout = PoolLayout(b)
    pts, space = listing(layout, "v")
    assert [p.unique_bytes for p in pts] == [40 * 4096, 0]
    fd = os.open(layout.point_undo("v", 1, "v"), os.O_RDONLY)
    try:
        assert int(fiemap_array(fd, 16 * MiB)["length"].sum()) == 40 * 4096
    finally:
        os.close(fd)
    assert space.points_bytes == 40 * 4096
    assert space.replica_bytes == 16 * MiB
    assert read_meta(layout, "v", 1)["members"]["v"]["data"] == "undo"


def test_select_by_generation_and_by_time(xfs_mod):
    u = Unit(xfs_mod, seed=5)
    for _ in range(3):
        u.sync()
        u.change()
    idx = u.index()
    p2 = idx.get(2)
    assert select(idx, 2, by_time=False) is p2
    assert select(idx, p2.time + 0.0001, by_time=True) is p2
    with pytest.raises(Exception, match="no recovery point"):
        select(idx, 99, by_time=False)
    with pytest.raises(Exception, match="at or before"):
        select(idx, idx.points[0].time - 10, by_time=True)


def test_a_fold_shares_runs_of_a_log_and_drops_preallocation(xfs_mod):
    """Rows that follow each other in a pruned point's log go to the older point's log in
    one FICLONERANGE (shared, not copied), each row's bytes where the new map says; and no
    block stays allocated past the log's end (XFS preallocates for files appended in turns)."""
    import numpy as np

    from drsvc.host.fiemap import FIEMAP_EXTENT_SHARED
    from drsvc.replication.points import undo_log
    d = xfs_mod / f"fold-{random.random()}"
    d.mkdir()
    src_img = d / "img"
    make_image(src_img, 8 * MiB, [(0, os.urandom(8 * MiB))])
    offs = np.arange(0, 64, 2, dtype=np.int64) * 4096          # 32 scattered 4 KiB ranges
    fd = os.open(src_img, os.O_RDONLY)
    try:
        rows, n = undo_log.append(d / "p.undo", undo_log.image_pieces(fd, (offs, offs + 4096), 8 * MiB))
    finally:
        os.close(fd)
    assert n == 32 * 4096 and list(rows[:, 2]) == list(range(0, 32 * 4096, 4096))
    pfd = os.open(d / "p.undo", os.O_RDONLY)
    try:
        moved, n2 = undo_log.append(d / "q.undo", undo_log.log_pieces(pfd, rows))
    finally:
        os.close(pfd)
    qfd = os.open(d / "q.undo", os.O_RDONLY)
    try:
        ext = fiemap_array(qfd, os.fstat(qfd).st_size)
        assert len(ext) and (ext["flags"] & FIEMAP_EXTENT_SHARED).all()     # shared with p's log
        for off, ln, pos in moved.tolist():
            assert os.pread(qfd, ln, pos) == src_img.read_bytes()[off:off + ln]
    finally:
        os.close(qfd)
    assert n2 == n
    for f in ("p.undo", "q.undo"):
        st = (d / f).stat()
        assert st.st_blocks * 512 <= st.st_size + 4096


def test_laying_an_undo_log_shares_its_small_ranges_too(xfs_mod):
    """A promote to a point lays undo logs over a reflink of a newer image. Every aligned
    range is shared from the log (FICLONERANGE), 4 KiB ones included: copying them read the
    log and copied a shared block on write, 4.11 s against 1.34 s for a 10 GiB volume 315 MiB
    back (bench.points). Unaligned ranges (an image's tail) are copied; zeros are punched."""
    import numpy as np

    from drsvc.host.fiemap import FIEMAP_EXTENT_SHARED
    from drsvc.replication.points import undo_log
    d = xfs_mod / "lay-small"
    d.mkdir()
    dst_path, log_path = d / "dst.img", d / "undo"
    dst_path.write_bytes(os.urandom(1 * MiB))
    log = os.urandom(12 * KiB)
    log_path.write_bytes(log)
    m = np.array(
        [[4 * KiB, 4 * KiB, 0], [64 * KiB, 4 * KiB, 4 * KiB], [200 * KiB, 8 * KiB, -1],
         [MiB - 1000, 1000, 8 * KiB]], dtype="int64")
    want = bytearray(dst_path.read_bytes())
    want[4 * KiB:8 * KiB] = log[:4 * KiB]
    want[64 * KiB:68 * KiB] = log[4 * KiB:8 * KiB]
    want[200 * KiB:208 * KiB] = bytes(8 * KiB)
    want[MiB - 1000:] = log[8 * KiB:8 * KiB + 1000]
    fd = os.open(dst_path, os.O_RDWR)
    try:
        undo_log.lay(fd, log_path, m)
        os.fsync(fd)
        ext = fiemap_array(fd, MiB)
    finally:
        os.close(fd)
    assert dst_path.read_bytes() == bytes(want)

    def shared(offset: int) -> bool:
        e = ext[(ext["logical"] <= offset) & (ext["logical"] + ext["length"] > offset)]
        return len(e) == 1 and bool(e["flags"][0] & FIEMAP_EXTENT_SHARED)
    assert shared(4 * KiB) and shared(64 * KiB)
    assert not shared(0) and not shared(MiB - 500)


def test_a_fold_of_an_interleaved_log_shares_it_whole_and_reads_none_of_it(xfs_mod):
    """A pruned point's log filled by two appends (its own undo, then a fold) holds rows
    whose positions interleave by offset. Taken in log order, the whole log is one run:
    the older point's log shares it (every extent shared) and nothing of the pruned log is
    read into the page cache (only ranges that are copied are asked for)."""
    import numpy as np

    from drsvc.host.fiemap import FIEMAP_EXTENT_SHARED
    from drsvc.replication.points import undo_log

    from ..receiver.test_journal import _cached
    d = xfs_mod / f"fold-order-{random.random()}"
    d.mkdir()
    src_img = d / "img"
    data = os.urandom(8 * MiB)
    make_image(src_img, 8 * MiB, [(0, data)])
    evens, odds = np.arange(0, 128, 2, dtype=np.int64) * 4096, np.arange(1, 128, 2, dtype=np.int64) * 4096
    fd = os.open(src_img, os.O_RDONLY)
    try:
        first, _ = undo_log.append(d / "p.undo", undo_log.image_pieces(fd, (evens, evens + 4096), 8 * MiB))
        second, _ = undo_log.append(d / "p.undo", undo_log.image_pieces(fd, (odds, odds + 4096), 8 * MiB))
    finally:
        os.close(fd)
    pmap = undo_log.merge_maps(first, second)
    assert list(pmap[:2, 2]) == [0, 64 * 4096]                    # by offset, the positions jump
    pfd = os.open(d / "p.undo", os.O_RDONLY)
    try:
        os.fsync(pfd)
        os.posix_fadvise(pfd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not any(_cached(d / "p.undo", off) for off in range(0, 128 * 4096, 4096))
        moved, n = undo_log.append(d / "q.undo", undo_log.log_pieces(pfd, undo_log.in_log_order(pmap)))
        assert not any(_cached(d / "p.undo", off) for off in range(0, 128 * 4096, 4096))
    finally:
        os.close(pfd)
    assert n == 128 * 4096
    qfd = os.open(d / "q.undo", os.O_RDONLY)
    try:
        ext = fiemap_array(qfd, os.fstat(qfd).st_size)
        assert len(ext) and (ext["flags"] & FIEMAP_EXTENT_SHARED).all()
        for off, ln, pos in moved.tolist():
            assert os.pread(qfd, ln, pos) == data[off:off + ln]
    finally:
        os.close(qfd)


def test_the_commit_reuses_the_index_read_before_the_apply_only_while_the_file_is_unchanged(tmp_path):
    """after_commit takes the Index that before_apply parsed for the same transaction (one
    parse per commit, not two), but reads the file again when anything rewrote it between
    the two, or when the transaction is another one."""
    import time

    from drsvc.replication.receiver import commit_points
    from drsvc.replication.points.index import Point
    lay = PoolLayout(tmp_path)
    lay.ensure_unit_dir("u")
    Index("u", [Point(1, time.time(), txid="t1")]).save(lay)
    tx = {"unit": "u", "txid": "t2"}
    read = commit_points._index_before_apply(lay, tx)
    assert commit_points._index_for_commit(lay, tx) is read
    assert commit_points._index_for_commit(lay, tx) is not read          # taken once
    read = commit_points._index_before_apply(lay, tx)
    Index("u", [Point(1, time.time(), txid="t1"), Point(2, time.time(), txid="t2")]).save(lay)
    again = commit_points._index_for_commit(lay, tx)
    assert again is not read and [p.generation for p in again.points] == [1, 2]
    commit_points._index_before_apply(lay, tx)
    assert commit_points._index_for_commit(lay, dict(tx, txid="t3")).points[-1].generation == 2


def test_a_point_of_another_release_is_read_by_its_known_keys():
    """Point.from_doc builds a point of this release in one call, and one written by another
    release (a key this one does not know) from the keys it knows; a point missing a
    required key is refused (the index is then CorruptMetadata)."""
    from drsvc.replication.points.index import Point
    doc = Point(3, 1.5, txid="t").to_doc()
    assert Point.from_doc(doc) == Point(3, 1.5, txid="t")
    assert Point.from_doc({**doc, "added_later": [1]}) == Point(3, 1.5, txid="t")
    with pytest.raises(TypeError):
        Point.from_doc({"time": 1.5})


def test_the_sync_report_shows_the_peers_undo_copy(xfs_mod):
    """A peer that answers once applied (``ack = "applied"``): its answer carries what its
    commit spent copying the overwritten ranges into the newest point's undo log
    (``peer_undo_s``, part of ``peer_apply_s``); nothing is copied where the grid keeps no
    point. (One acking at its commit marker keeps these in its receive record:
    test_durable_ack.)"""
    u = Unit(xfs_mod, seed=5)
    u.peer.ack = "applied"
    reports = []
    for grid in ("1x1000w(keep=all)", "1x1000w(keep=all)", "none"):
        reports.append(sync_unit(u.a, u.unit, u.vols, u.peer, origin=origin(grid)))
        u.change()
    first, kept, none = (r.phases for r in reports)
    assert first["peer_undo_s"] == 0            # a first copy overwrites nothing
    assert 0 < kept["peer_undo_s"] <= kept["peer_apply_s"]
    assert none["peer_undo_s"] == 0
    # the copy made as the records arrived: only where a point keeps the overwritten bytes
    assert first["peer_undo_ahead_s"] == 0 and none["peer_undo_ahead_s"] == 0
    assert kept["peer_undo_ahead_s"] > 0 and "peer_undo_wait_s" in kept


def test_the_commit_keeps_the_undo_copies_made_as_records_arrived(xfs_mod):
    """``UndoAhead`` copies the replica's bytes under the spans it is given into the newest
    point's undo log; the commit (``keep_overwritten``) adopts those copies where they lie and
    copies only the spans they miss, and the point rebuilds to its generation's bytes."""
    u = Unit(xfs_mod, seed=6)
    gen = u.sync()
    vol = u.vols[0]
    size = os.path.getsize(u.layout.image(vol))
    tx = {"unit": u.unit, "txid": "tx-early", "mode": "delta", "two_phase": False, "kind": "volume",
          "base": gen, "target": gen + 1, "captured_at": None, "origin": origin("1x1000w(keep=all)"),
          "members": [{"volume_id": vol, "size": size, "base_size": size, "fresh": False}]}
    early_spans = [(0, 0, 8 * KiB), (0, 1 * MiB, 128 * KiB), (0, 3 * MiB + 4 * KiB, 4 * KiB)]
    # arrived after the early copy's last batch; below an early span, so a commit that copied
    # everything again (in offset order) would put the early spans elsewhere in the log
    late_spans = [(0, 512 * KiB, 64 * KiB)]
    ahead = UndoAhead.wanted(u.layout, tx)
    for span in early_spans:
        ahead.want(*span)
    early = ahead.finish()
    rows = early[vol].rows
    assert early[vol].generation == gen
    assert [tuple(r[:2]) for r in rows.tolist()] == [(o, n) for _m, o, n in early_spans]
    idx = u.index()
    commit_points.keep_overwritten(u.layout, idx, idx.newest, tx, lambda: iter(early_spans + late_spans), early)
    meta = read_meta(u.layout, u.unit, gen)
    kept = {(o, n): at for o, n, at in undo_map(meta, vol).tolist()}
    assert {k: kept[k] for k in [tuple(r[:2]) for r in rows.tolist()]} == {
        (o, n): at for o, n, at in rows.tolist()}                  # adopted where they lie
    assert kept[(512 * KiB, 64 * KiB)] >= undo_log.log_end(rows)   # the rest appended after them
    # bytes kept: the span at 3 MiB lies in the image's zero half, kept as a zero row at no cost
    assert kept[(3 * MiB + 4 * KiB, 4 * KiB)] == -1
    assert meta["members"][vol]["bytes"] == 8 * KiB + 128 * KiB + 64 * KiB
    # the point's bytes, rebuilt from its undo log over a replica overwritten where the spans are
    with open(u.layout.image(vol), "r+b") as f:
        for _m, o, n in early_spans + late_spans:
            f.seek(o)
            f.write(os.urandom(n))
    out = u.b / "rebuilt.img"
    # the index as the commit leaves it: a newer point, the replica, after the one that keeps the undo
    fake = Index(u.unit, idx.points + [replace(idx.points[-1], generation=gen + 1)])
    build_image(u.layout, fake, fake.points[-2], vol, out)
    assert sha(out) == u.shas[gen][vol]
