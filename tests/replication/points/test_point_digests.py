"""Recovery points' recorded digests, on loop XFS with the real receiver: every undo log the
receiver writes (as the records arrive, at the commit, and by the folds of pruned points)
has a digest for each of its 4 KiB blocks, a sealed image has the replica's block map, and
the points part of a verify (``control.scrub_points``) finds a flipped byte in either and
names the point, the volume offset and the file offset; a log kept without digests is
unverifiable, not clean."""
from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest

from drsvc.replication.common import ranges
from drsvc.replication.common.read_pacer import ReadPacer
from drsvc.replication.control.scrub_points import PointsCheck
from drsvc.replication.points import undo_log
from drsvc.replication.points.index import UNDO, member_data, read_meta, undo_map
from drsvc.replication.points.restore import take_over
from drsvc.replication.receiver import commit_points

from .test_point_history import Unit


def _check(u: Unit, window_bytes: int = 64 << 10) -> dict:
    """The points part of a verify of u's replica (no other sync runs here: no lock needed)."""
    scrub = SimpleNamespace(layout=u.layout, unit_id=u.unit, _lock=contextlib.nullcontext,
                            pacer=ReadPacer(0), sleep=lambda s: None, notes=[])
    return PointsCheck(scrub, window_bytes).run()


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _undo_members(u: Unit):
    idx = u.index()
    for p in idx.points:
        meta = read_meta(u.layout, u.unit, p.generation)
        for v in p.members:
            if member_data(meta, v, newest=p is idx.newest) == UNDO and len(undo_map(meta, v)):
                yield p.generation, v, undo_map(meta, v)


def _history(u, changes: int) -> int:
    """*changes* syncs each followed by a change, then a last sync: its generation."""
    for _ in range(changes):
        u.sync()
        u.change()
    return u.sync()

def test_every_undo_log_has_digests_and_checks_clean_through_folds(xfs_mod):
    u = Unit(xfs_mod, vols=("v1", "v2"), seed=11)
    _history(u, 6)
    for _ in range(3):                               # prunes: the folds append to older logs
        u.change()
        u.sync("1x1000w(keep=2)")
    kept = u.check_all()
    logs = list(_undo_members(u))
    assert logs, "the points keep undo logs"
    for gen, v, m in logs:
        sums = u.layout.point_undo_sums(u.unit, gen, v)
        # one digest per 4 KiB block the map's bytes take, and the header
        assert os.path.getsize(sums) == 16 + undo_log.log_end(m) // 4096 * 16, (gen, v)
    got = _check(u)
    assert got["damaged_points"] == [] and got["unverifiable"] == [] and got["bad_blocks"] == 0, got
    assert got["checked_members"] >= len(logs) and len(kept) >= 3


def test_a_flipped_byte_in_an_undo_log_is_named_by_point_and_offset(xfs_mod):
    u = Unit(xfs_mod, seed=12)
    _history(u, 4)
    gen, v, m = next(_undo_members(u))
    data_rows = m[m[:, 2] >= 0]
    off, length, pos = (int(x) for x in data_rows[len(data_rows) // 2])
    at = pos + min(length - 1, 4096 + 17)            # a byte inside the range's bytes in the log
    _flip(u.layout.point_undo(u.unit, gen, v), at)
    got = _check(u)
    assert got["damaged_points"] == [gen] and got["bad_blocks"] == 1, got
    [bad] = got["damaged"]
    block = at - at % 4096
    assert (bad["point"], bad["volume"], bad["file_offset"], bad["data"]) == (gen, v, block, "undo"), bad
    # the volume's offset of the block's first byte of the range, and the flipped byte inside it
    assert bad["offset"] == off + max(0, block - pos) and bad["offset"] <= off + (at - pos) < bad["offset"] + bad["length"]


def test_a_log_kept_without_digests_is_unverifiable_not_clean(xfs_mod):
    u = Unit(xfs_mod, seed=13)
    _history(u, 3)
    gen, v, m = next(_undo_members(u))
    u.layout.point_undo_sums(u.unit, gen, v).unlink()        # as a release that kept none wrote it
    got = _check(u)
    assert got["damaged_points"] == []
    assert {(x["point"], x["volume"]) for x in got["unverifiable"]} == {(gen, v)}
    assert got["unverifiable"][0]["bytes"] == undo_log.map_bytes(m)
    # the next append to that log records digests from where it begins: older blocks stay unverifiable
    u.change()
    u.sync("1x1000w(keep=1)")                    # prunes the newer points into it
    again = _check(u)
    assert not again["damaged_points"], again


def test_a_sealed_image_takes_the_replica_map_and_a_flip_in_it_is_found(xfs_mod):
    u = Unit(xfs_mod, seed=14)
    gen = _history(u, 3)
    take_over(u.b, u.unit)                       # a promote's seal: the newest point gets a whole image
    mapfile = u.layout.point_image_map(u.unit, gen, "v")
    assert mapfile.exists()
    assert member_data(read_meta(u.layout, u.unit, gen), "v") == "full"
    got = _check(u)
    assert got["damaged_points"] == [] and not got["unverifiable"], got
    image = u.layout.point_image(u.unit, gen, "v")
    with open(image, "rb") as f:
        data_at = next(i * 4096 for i, blk in enumerate(iter(lambda: f.read(4096), b"")) if any(blk))
    _flip(image, data_at + 99)
    got = _check(u)
    assert got["damaged_points"] == [gen], got
    assert [(d["data"], d["offset"], d["file_offset"]) for d in got["damaged"]] == [("full", data_at, data_at)]


@pytest.mark.parametrize("share", [True, False], ids=["reflink", "copy"])
def test_a_damaged_range_a_fold_moves_stays_found_in_the_point_it_moves_to(xfs_mod, monkeypatch, share):
    """A prune folds the pruned point's ranges into the older point's log (``commit_points.
    fold``, run here as the receiver runs it), by reflink where a run is long enough and by
    copy where not, or where the filesystem shares nothing (the second case refuses every
    FICLONERANGE). Either way the older log takes the digests recorded as the source was
    written, not digests of the bytes the fold read: a byte flipped in the pruned point's log
    is found by a verify afterwards in the point that now holds it too."""
    u = Unit(xfs_mod, seed=15)
    _history(u, 4)
    logs = list(_undo_members(u))
    (qgen, v, qmap), (pgen, _, pmap) = logs[1], logs[2]
    moved = undo_log.clip(pmap, ranges.subtract(undo_log.covered(pmap), undo_log.covered(qmap)))
    rows = [(int(off), int(ln), int(pos)) for off, ln, pos in moved.tolist() if pos >= 0]
    assert rows
    for _off, ln, pos in rows:                   # a byte in every range the fold moves
        _flip(u.layout.point_undo(u.unit, pgen, v), pos + min(ln - 1, 17))
    assert _check(u)["damaged_points"] == [pgen]

    if not share:
        monkeypatch.setattr(undo_log, "_clone", lambda *a: False)
    idx = u.index()
    by_gen = {p.generation: p for p in idx.points}
    commit_points.fold(u.layout, idx, by_gen[pgen], by_gen[qgen])
    monkeypatch.undo()
    got = _check(u)
    assert got["damaged_points"] == [qgen, pgen], got
    found = sorted(d["offset"] for d in got["damaged"] if d["point"] == qgen)
    assert found == sorted(off + min(ln - 1, 17) // 4096 * 4096 for off, ln, _pos in rows), (found, rows)


@pytest.mark.parametrize("damaged", [False, True], ids=["clean", "damaged"])
def test_a_point_made_whole_by_a_fold_takes_its_sources_digests(xfs_mod, damaged):
    """A pruned point kept as a whole image makes the older point whole too (``commit_points.
    fold`` builds its image from the newer image and its own undo log). The new image's map
    comes from the digests recorded for those sources: clean sources verify clean, and a
    byte flipped in the newer image or in the undo log before the fold is found in the
    new image afterwards, at its volume offset."""
    u = Unit(xfs_mod, seed=16)
    gen = _history(u, 3)
    take_over(u.b, u.unit)                       # the newest point becomes a whole image
    idx = u.index()
    by_gen = {p.generation: p for p in idx.points}
    p, q = by_gen[gen], by_gen[gen - 1]
    qmap = undo_map(read_meta(u.layout, u.unit, q.generation), "v")
    data = qmap[qmap[:, 2] >= 0]
    want = []
    if damaged:
        off, ln, pos = (int(x) for x in data[len(data) // 2])
        _flip(u.layout.point_undo(u.unit, q.generation, "v"), pos + min(ln - 1, 9))
        want.append(off + min(ln - 1, 9) // 4096 * 4096)
        # a block of the newer image the undo log does not cover
        laid = undo_log.covered(qmap)
        image = u.layout.point_image(u.unit, p.generation, "v")
        with open(image, "rb") as f:
            blocks = iter(lambda: f.read(4096), b"")
            at = next(i * 4096 for i, blk in enumerate(blocks) if any(blk)
                      and not len(ranges.intersect(laid, ranges.from_pairs([(i * 4096, i * 4096 + 4096)]))[0]))
        _flip(image, at + 5)
        want.append(at)
    commit_points.fold(u.layout, idx, p, q)
    assert member_data(read_meta(u.layout, u.unit, q.generation), "v") == "full"
    got = _check(u)
    found = sorted(d["offset"] for d in got["damaged"] if d["point"] == q.generation)
    assert found == sorted(want), got
    assert not got["unverifiable"], got
