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

from drsvc.replication.common.read_pacer import ReadPacer
from drsvc.replication.control.scrub_points import PointsCheck
from drsvc.replication.points import undo_log
from drsvc.replication.points.index import UNDO, member_data, read_meta, undo_map
from drsvc.replication.points.restore import take_over

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
