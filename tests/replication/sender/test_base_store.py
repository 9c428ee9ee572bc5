"""The sender's base rolls forward while the peer commits (``base_store.Preroll``).

The overlay capture leaves the new generation's changed ranges beside its base; the base
must become that generation once the peer commits. The roll (one reflink per range) is
made into a reflink of the base from the trailer on, so the adopt only renames it
in; the base itself stays as it was until then, so a generation the peer never commits
leaves a base still good for the next delta. Real XFS, real receiver processes.
"""
import logging
import os

import pytest

from drsvc.errors import DrsvcError
from drsvc.replication.sender import base_store
from drsvc.replication import sync_unit
from drsvc.layout import PoolLayout
from drsvc.replication.common.unit_state import get_state
from drsvc.transport.local import LocalPeer
from tests.fixtures.xfs import need

from ..conftest import make_image, new_sites, same_images, sha, write_at

MiB = 1 << 20
SIZE = 16 * MiB


def _seeded(root):
    """A volume synced once (generation 1, a whole base image) and changed since."""
    need("mkfs.xfs")
    a, b = new_sites(root)
    img = a / "images" / "v.img"
    make_image(img, SIZE, [(0, os.urandom(SIZE))])
    peer = LocalPeer(b)
    sync_unit(a, "v", ["v"], peer)
    for off in (1 * MiB, 5 * MiB + 8192, 11 * MiB):
        write_at(img, off, os.urandom(64 << 10))
    return a, b, img, peer, PoolLayout(a)


def _ino(path) -> int:
    return os.stat(path).st_ino


def _leftovers(d) -> list:
    return sorted(p.name for p in d.iterdir() if p.name.endswith((".next", ".part", ".delta", ".ranges", ".clear")))


def test_the_adopt_takes_the_image_rolled_while_on_the_wire(xfs_mod):
    a, b, img, peer, layout = _seeded(xfs_mod)
    base = layout.snap_dir("v", 1) / "v.img"
    base_ino = _ino(base)
    rep = sync_unit(a, "v", ["v"], peer)
    assert rep.steps == ["sync"] and rep.ranges_cloned > 0        # an overlay capture
    new_base = layout.snap_dir("v", 2) / "v.img"
    # rolled into a reflink of the base, not the base rolled in place and moved
    assert _ino(new_base) != base_ino
    assert rep.phases["preroll_s"] > 0 and "roll_wait_s" in rep.phases
    assert sha(new_base) == sha(img)
    assert not layout.snap_dir("v", 1).exists() and _leftovers(layout.snap_dir("v", 2)) == []
    same_images(a, b, ["v"])
    write_at(img, 3 * MiB, os.urandom(MiB))                      # the next delta plans against it
    assert sync_unit(a, "v", ["v"], peer).bytes_changed == MiB
    same_images(a, b, ["v"])


def test_a_generation_the_peer_did_not_commit_leaves_the_base_as_it_was(xfs_mod):
    a, b, img, peer, layout = _seeded(xfs_mod)
    base = layout.snap_dir("v", 1) / "v.img"
    before = sha(base)
    with pytest.raises(DrsvcError):
        sync_unit(a, "v", ["v"], LocalPeer(b, env={"DRSVC_FAILPOINTS": "receiver.before_commit"}))
    assert get_state(a, "v").generation == 1
    assert sha(base) == before                                   # still generation 1
    rolled = layout.snap_dir("v", 2) / f"v{base_store.PREROLLED}"
    assert sha(rolled) == sha(img)
    rolled_ino = _ino(rolled)
    rep = sync_unit(a, "v", ["v"], peer)                         # resumes generation 2, then adopts it
    assert "resume" in rep.steps and get_state(a, "v").generation == 2
    assert _ino(layout.snap_dir("v", 2) / "v.img") == rolled_ino
    same_images(a, b, ["v"])


def test_an_adopt_cut_short_after_the_state_finishes_with_the_rolled_image(xfs_mod, monkeypatch):
    """The state records generation 2, then the process stops before the rename: the next
    sync's ``recover`` renames the rolled image in (the base was never touched)."""
    a, b, img, peer, layout = _seeded(xfs_mod)
    real_roll = base_store._roll

    def stop(*args):
        raise KeyboardInterrupt("stopped between the state and the roll")
    monkeypatch.setattr(base_store, "_roll", stop)
    with pytest.raises(KeyboardInterrupt):
        sync_unit(a, "v", ["v"], peer)
    monkeypatch.setattr(base_store, "_roll", real_roll)
    assert get_state(a, "v").generation == 2
    d = layout.snap_dir("v", 2)
    rolled_ino = _ino(d / f"v{base_store.PREROLLED}")
    assert not (d / "v.img").exists()
    rep = sync_unit(a, "v", ["v"], peer)
    assert rep.steps == ["sync"] and rep.records == 0
    assert not d.exists() and _ino(layout.snap_dir("v", 3) / "v.img") != rolled_ino   # rolled on
    assert sha(layout.snap_dir("v", 3) / "v.img") == sha(img)
    same_images(a, b, ["v"])


def test_a_failed_preroll_leaves_the_adopt_its_roll_in_place(xfs_mod, monkeypatch, caplog):
    a, b, img, peer, layout = _seeded(xfs_mod)
    base_ino = _ino(layout.snap_dir("v", 1) / "v.img")

    def no_space(*args, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(base_store, "clone_file", no_space)
    with caplog.at_level(logging.WARNING, logger="drsvc.replication.sender.base_store"):
        sync_unit(a, "v", ["v"], peer)
    assert "not rolled ahead" in caplog.text
    d = layout.snap_dir("v", 2)
    assert _ino(d / "v.img") == base_ino                         # the base, rolled in place, moved in
    assert sha(d / "v.img") == sha(img) and _leftovers(d) == []
    same_images(a, b, ["v"])


def test_an_image_of_many_extents_per_range_changed_is_rolled_in_place(tmp_path):
    """The rule: the whole-base reflink costs per extent, so a generation changing few ranges
    of a fragmented image is not rolled ahead (its extent count comes from the capture's
    kept extent map, its ranges from ``.ranges``)."""
    import numpy as np

    from drsvc.host.fiemap import EXTENT_DTYPE
    from drsvc.replication.sender.capture import _EXT_HEADER

    def overlay(ranges, extents):
        (tmp_path / "v.ranges").write_bytes(bytes(16 * ranges))
        (tmp_path / "v.extents").write_bytes(bytes(_EXT_HEADER.size + extents * np.dtype(EXTENT_DTYPE).itemsize))
        return base_store.worth_rolling_ahead(tmp_path, "v")
    assert overlay(2595, 15133)                 # 1% of a 1 GiB image, as the bench's
    assert not overlay(2594, 112053)            # 1% of the aged one
    assert overlay(2, 200)                      # a small image, whatever it changed
    assert not overlay(2, 4000)                 # an idle sync: its roll in place is cheaper than the reflink
    assert overlay(26000, 40000)                # 10%
    (tmp_path / "v.extents").unlink()
    assert not base_store.worth_rolling_ahead(tmp_path, "v")     # no extent map kept: unknown


def test_a_generation_not_worth_rolling_ahead_is_rolled_at_the_adopt(xfs_mod, monkeypatch):
    a, b, img, peer, layout = _seeded(xfs_mod)
    base_ino = _ino(layout.snap_dir("v", 1) / "v.img")
    monkeypatch.setattr(base_store, "PREROLL_SMALL", 0)
    monkeypatch.setattr(base_store, "PREROLL_EXTENTS_PER_RANGE", 0)
    rep = sync_unit(a, "v", ["v"], peer)
    d = layout.snap_dir("v", 2)
    assert rep.phases["preroll_s"] == 0 and _ino(d / "v.img") == base_ino
    assert sha(d / "v.img") == sha(img) and _leftovers(d) == []
    same_images(a, b, ["v"])


def test_a_delta_planned_beside_the_stream_is_rolled_once_its_plan_is_whole(xfs_mod):
    """Over a slow link a delta's plan reads while its records leave (pipelined); the preroll,
    whose reflinks would slow those reads, starts once the plan is whole, before the trailer."""
    a, b, img, peer, layout = _seeded(xfs_mod)
    base_ino = _ino(layout.snap_dir("v", 1) / "v.img")
    rep = sync_unit(a, "v", ["v"], peer, bwlimit=512 << 10)     # 192 KiB at 512 KiB/s: wire-bound
    assert rep.pipelined and rep.phases["preroll_s"] > 0
    new_base = layout.snap_dir("v", 2) / "v.img"
    assert _ino(new_base) != base_ino and sha(new_base) == sha(img)
    same_images(a, b, ["v"])


def test_the_preroll_starts_once_every_record_is_out(xfs_mod, monkeypatch):
    """Beside the send, the preroll's reflinks slow the send's reads of the overlay (1% of
    1 GiB on loopback: send_s 0.108 s beside it, 0.092 s after it), so it starts at the
    trailer, while the peer commits. The old code started it with the first record."""
    from drsvc.replication.sender import stream as stream_mod
    a, b, img, peer, layout = _seeded(xfs_mod)
    events = []
    real_send, real_preroll = stream_mod._send_records, base_store.preroll

    def send(*args, **kw):
        out = real_send(*args, **kw)
        events.append("records out")
        return out

    def preroll(*args, **kw):
        events.append("preroll")
        return real_preroll(*args, **kw)
    monkeypatch.setattr(stream_mod, "_send_records", send)
    monkeypatch.setattr(base_store, "preroll", preroll)
    rep = sync_unit(a, "v", ["v"], peer)
    assert events == ["records out", "preroll"]
    assert rep.phases["preroll_s"] > 0 and sha(layout.snap_dir("v", 2) / "v.img") == sha(img)
    same_images(a, b, ["v"])


def _gated_preroll(monkeypatch):
    """The preroll held until the returned event is set: a roll that outlasts the sync."""
    import threading
    gate, real = threading.Event(), base_store.preroll

    def preroll(*args, **kw):
        assert gate.wait(60), "the gate was never opened"
        return real(*args, **kw)
    monkeypatch.setattr(base_store, "preroll", preroll)
    return gate


def test_a_worker_sync_returns_before_its_base_rolls_and_the_next_reader_waits(xfs_mod, monkeypatch):
    """roll_behind (as a worker's job syncs): the call returns once the peer holds the
    generation and this end recorded it, with the roll still running under the unit's roll
    lock and the unit's lock free. The next sync waits for that roll before it reads the
    base, and plans its delta against the rolled base."""
    import threading
    from drsvc.errors import OperationInProgress
    from drsvc import store
    a, b, img, peer, layout = _seeded(xfs_mod)
    gate = _gated_preroll(monkeypatch)
    rep = sync_unit(a, "v", ["v"], peer, roll_behind=True)
    assert rep.target_generation == 2 and get_state(a, "v").generation == 2
    assert rep.phases["roll_wait_s"] < 1 and "preroll_s" not in rep.phases
    with pytest.raises(OperationInProgress), store.file_lock(layout.roll_lock_path("v"), blocking=False, key="v"):
        pass                                                         # the roller holds it
    assert not (layout.snap_dir("v", 2) / "v.img").exists()          # not rolled in yet
    write_at(img, 3 * MiB, os.urandom(MiB))
    nxt = {}
    t = threading.Thread(target=lambda: nxt.update(rep=sync_unit(a, "v", ["v"], peer)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and "rep" not in nxt                        # waiting for the roll
    gate.set()
    t.join(60)
    assert nxt["rep"].bytes_changed == MiB and nxt["rep"].target_generation == 3
    assert not layout.snap_dir("v", 1).exists() and not layout.snap_dir("v", 2).exists()
    assert sha(layout.snap_dir("v", 3) / "v.img") == sha(img) and _leftovers(layout.snap_dir("v", 3)) == []
    same_images(a, b, ["v"])


def test_a_roll_behind_that_failed_is_finished_by_the_next_sync(xfs_mod, monkeypatch, caplog):
    """The roller's failure is only logged: the generation is recorded, and the next reader
    of the base (here the next sync's sweep) rolls it in place."""
    a, b, img, peer, layout = _seeded(xfs_mod)
    real = base_store._roll
    calls = []

    def roll_once_failing(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "injected")
        return real(*args, **kw)
    monkeypatch.setattr(base_store, "_roll", roll_once_failing)
    with caplog.at_level(logging.WARNING):
        sync_unit(a, "v", ["v"], peer, roll_behind=True)
        base_store.wait_for_roll(layout, "v")
    assert "not rolled in after the sync" in caplog.text
    assert get_state(a, "v").generation == 2 and not (layout.snap_dir("v", 2) / "v.img").exists()
    rep = sync_unit(a, "v", ["v"], peer)
    assert len(calls) == 3 and rep.target_generation == 3       # finished by the sweep, then its own
    assert sha(layout.snap_dir("v", 3) / "v.img") == sha(img)
    same_images(a, b, ["v"])


def test_a_process_that_exits_after_a_roll_behind_finishes_it_first(xfs_mod):
    """The roll still running as the caller's process ends (here held a second past the
    return): the process finishes it before it exits."""
    import subprocess
    import sys
    a, b, img, peer, layout = _seeded(xfs_mod)
    code = ("import time; from drsvc.replication import sync_unit; from drsvc.transport.local import LocalPeer; "
            "from drsvc.replication.sender import base_store; real = base_store.preroll; "
            "base_store.preroll = lambda *a, **k: (time.sleep(1), real(*a, **k)); "
            f"sync_unit({str(a)!r}, 'v', ['v'], LocalPeer({str(b)!r}), roll_behind=True)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    assert get_state(a, "v").generation == 2
    assert sha(layout.snap_dir("v", 2) / "v.img") == sha(img) and not layout.snap_dir("v", 1).exists()
