"""On a real two-site lab: the DR site verifies (scrubs) its copy, and repairs it.

Everything goes through the plugins' gRPC (the drsvc Admin service's Verify, SyncNow and
status), the CLI (`drsvc verify --json`) and the site's workers, which run the verify at the
secondary. A byte flipped in b's replica image is found (its offset named, against both the
receiver's block map and the primary's snapshot), makes the status VERIFY_FAILED, the
metric's inputs say so and a promote without force is refused; the repair re-sends about one
block, and the copy is then byte-equal to the primary's snapshot. A verify beside a
scheduled sync of a unit being written loses nothing, and both finish; so does a second
verify of the unit running at the same time.

A byte flipped in a kept recovery point's undo log at b is found too, by `drsvc verify` and
by a scheduled verify, named by point, volume offset and log offset; the status says the
point cannot be repaired from the primary, and a promote to it is refused unless forced. A
drill's clone of a damaged copy or point is refused the same way."""
from __future__ import annotations

import io
import json
import threading
import time
from contextlib import redirect_stdout

import grpc
import pytest

from drsvc.layout import PoolLayout
from drsvc.replication.sender.base_store import wait_for_roll
from drsvc.replication.control.scrub import Scrub
from drsvc.replication.points.index import read_meta, undo_map
from drsvc.replication.common.unit_state import find_state
from drsvc.replication.receiver import wait_for_apply
from drsvc_cli.client import DrClient, RpcFailed
from drsvc_cli.main import main as cli
from tests.dr.helpers import generation, wait_for, write_random
from tests.faults.steps import check_converged, file_sha, peer_of
from tests.fixtures.sites import image_sha

BS = 4096
HOUR = {"schedulingInterval": "1h"}


def _clients(lab):
    return DrClient(lab.sites["a"].endpoint), DrClient(lab.sites["b"].endpoint)


def _replicated(lab, a: DrClient, name: str, size: int = 64 << 20, params=None) -> str:
    vid = lab.clients["a"].create_volume(name, size).volume_id
    write_random(lab.sites["a"], vid, count=64, seed=name)
    a.until_done(lambda: a.replication("EnableVolumeReplication", volume_id=vid,
                                       parameters={**HOUR, **(params or {})}), wait=60)
    wait_for(lambda: generation(lab.sites["b"], vid) >= 1, 90, what="the initial sync")
    return vid


def _flip(site, vid: str, offset: int) -> None:
    path = site.pool / "images" / f"{vid}.img"
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
        f.flush()


def _blocks(site, vid: str):
    with open(site.pool / "images" / f"{vid}.img", "rb") as f:
        i = 0
        while block := f.read(BS):
            yield i, block.count(0) == len(block)
            i += 1


def _data_block(site, vid: str) -> int:
    return next(i for i, zero in _blocks(site, vid) if not zero and i > 0)


def _zero_block(site, vid: str) -> int:
    return next(i for i, zero in _blocks(site, vid) if zero and i > 4000)


def _cli_json(*argv) -> tuple[int, dict]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli(list(argv))
    return code, json.loads(buf.getvalue().strip().splitlines()[-1])


def test_a_flipped_byte_is_found_refuses_a_promote_and_the_repair_sends_one_block(lab):
    a, b = _clients(lab)
    sa, sb = lab.sites["a"], lab.sites["b"]
    try:
        vid = _replicated(lab, a, "verify-flip")
        a.until_done(lambda: a.sync_now(volume_id=vid, wait=60), wait=90)     # a delta: the maps follow it
        clean = b.verify(volume_id=vid, wait=120)
        assert clean["result"] == "clean", clean
        assert clean["checked"] == {"recorded": True, "primary": True}
        assert clean["bytes_read"] > 0 and not clean["mismatches"]

        # one byte in a block of data, one in a block of zeros (a hole at the primary)
        offsets = sorted([_data_block(sa, vid) * BS + 123, _zero_block(sa, vid) * BS + 7])
        for off in offsets:
            _flip(sb, vid, off)
        code, doc = _cli_json("verify", "--endpoint", sb.endpoint, "--volume", vid, "--json")
        assert code == 1 and doc["ok"] is False and doc["error"]["code"] == "VERIFY_FAILED", doc
        found = doc["result"]
        assert found["result"] == "mismatch" and found["mismatched_blocks"] == len(offsets)
        assert [(m["volume_id"], m["offset"], m["length"], m["against"]) for m in found["mismatches"]] == \
            [(vid, off - off % BS, BS, "both") for off in offsets]
        g = generation(sb, vid)
        assert all(m["generation"] == g for m in found["mismatches"])

        st = b.status(volume_id=vid)
        assert st["status"] == "VERIFY_FAILED" and f"{vid}@{offsets[0] - offsets[0] % BS}" in st["status_message"], st
        assert st["verify"]["failed"] and st["verify"]["mismatched_blocks"] == 2 and st["verify"]["generation"] == g
        with pytest.raises(RpcFailed) as e:
            b.until_done(lambda: b.replication("PromoteVolume", volume_id=vid, force=False), wait=60)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "failed its verify" in e.value.message
        assert find_state(sb.pool, vid).role == "secondary"
        # a drill's clone of the damaged copy too, unless forced (to look at it)
        with pytest.raises(RpcFailed) as e:
            b.clone_replica("bad", volume_id=vid)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "clone with force" in e.value.message, e.value
        code, doc = _cli_json("clone", "--endpoint", sb.endpoint, "--volume", vid, "--prefix", "look", "--force", "--json")
        assert code == 0 and doc["result"]["generation"] == g and len(doc["result"]["clones"]) == 1, doc
        b.delete_volume(doc["result"]["clones"][0]["clone"])

        asked = b.verify(volume_id=vid, repair=True, wait=120)
        assert asked["result"] == "mismatch" and asked["repair_requested"]
        assert b.status(volume_id=vid)["status"] == "VERIFY_FAILED"         # until the repair commits
        assert find_state(sb.pool, vid).repair["runs"] == {vid: [[off - off % BS, BS] for off in offsets]}
        a.until_done(lambda: a.sync_now(volume_id=vid, wait=60), wait=90)
        wait_for_apply(PoolLayout(sb.pool), vid)     # b records the repair's end once applied
        # the next delta re-sends the differing blocks by name, nothing else: one block per
        # flipped byte (the data block as data, the block of zeros as a zero record); the
        # primary's one-flight begin was refused once, for the status that names them
        rep = find_state(sa.pool, vid).reports[-1]
        assert rep["mode"] == "delta" and rep["repair"], rep
        assert (rep["bytes_changed"], rep["bytes_zeroed"]) == (BS, BS), rep
        assert rep["bytes_scanned"] <= 4 * BS, rep          # no read of the whole copy, at either end
        assert rep["bytes_on_wire"] < 4 * BS + (16 << 10), rep
        assert not find_state(sb.pool, vid).repair
        acked = find_state(sa.pool, vid).generation
        wait_for_roll(PoolLayout(sa.pool), vid)     # the worker rolls its base after the sync returns
        assert file_sha(PoolLayout(sa.pool).snap_dir(vid, acked) / f"{vid}.img") == image_sha(sb, vid)
        st = b.status(volume_id=vid)
        assert st["status"] != "VERIFY_FAILED" and not st["verify"]["failed"], st
        again = b.verify(volume_id=vid, wait=120)
        assert again["result"] == "clean" and again["checked"]["primary"], again
    finally:
        a.close()
        b.close()


def test_verify_is_refused_at_the_primary(lab):
    a, b = _clients(lab)
    try:
        vid = _replicated(lab, a, "verify-prim")
        code, doc = _cli_json("verify", "--endpoint", lab.sites["a"].endpoint, "--volume", vid, "--json")
        assert code == 4 and doc["error"]["code"] == "FAILED_PRECONDITION", doc
        assert "run it at the site that holds the copy" in doc["error"]["message"]
    finally:
        a.close()
        b.close()


def test_a_verify_beside_scheduled_syncs_of_a_written_unit_loses_nothing(lab):
    """A capped verify (b's verify_read_rate) takes several windows while a 2 s schedule
    lands syncs of a unit being written: the verify reports no false mismatch, sees the
    generation move, and the syncs go on; after the writer stops both copies are equal."""
    sb = lab.sites["b"]
    text = sb.config_path.read_text()
    first_table = text.index("\n[") + 1
    sb.config_path.write_text(text[:first_table] + 'verify_read_rate = "12MiB/s"\n' + text[first_table:])
    sb.run.down()
    sb.run.up()
    a, b = _clients(lab)
    stop = threading.Event()
    try:
        vid = lab.clients["a"].create_volume("verify-busy", 96 << 20).volume_id
        write_random(lab.sites["a"], vid, count=1400, seed="busy")      # 1400 random 64 KiB writes: ~58 MiB of data
        a.until_done(lambda: a.replication("EnableVolumeReplication", volume_id=vid,
                                           parameters={"schedulingInterval": "2s"}), wait=60)
        wait_for(lambda: generation(sb, vid) >= 2, 120, what="two syncs")

        def writer():
            i = 0
            while not stop.is_set():
                write_random(lab.sites["a"], vid, count=8, size=BS, seed=f"w{i}")
                i += 1
                time.sleep(0.2)
        t = threading.Thread(target=writer, daemon=True)
        t.start()
        before = generation(sb, vid)
        # a second verify of the unit at once, as a scheduled one may run beside an operator's:
        # each has a scratch directory of its own, and both end clean
        second: dict = {}

        def other():        # the engine's verify, as b's scheduled run makes it, capped the same
            try:
                second["r"] = Scrub(sb.pool, vid, lambda: peer_of(sb, "a"), read_rate=12 << 20).run()
            except Exception as e:  # noqa: BLE001 - asserted below
                second["e"] = e
        t2 = threading.Thread(target=other, daemon=True)
        t2.start()
        time.sleep(1.0)     # the engine's run is reading the primary's maps (capped) as this one starts
        r = b.verify(volume_id=vid, wait=300)
        t2.join(300)
        stop.set()
        t.join()
        assert r["result"] == "clean", r
        assert "e" not in second and second["r"]["result"] == "clean", second
        assert not any(PoolLayout(sb.pool).verify_tmp(vid).glob("*")), "a verify's scratch was left"
        assert r["end_generation"] > r["generation"] >= before, r       # syncs landed while it ran
        assert r["bytes_read"] >= 48 << 20 and r["checked"] == {"recorded": True, "primary": True}
        after = generation(sb, vid)
        wait_for(lambda: generation(sb, vid) >= after + 2, 60, what="syncs after the verify")
        # every generation the primary acked is at the copy, byte for byte
        check_converged(lab.sites["a"], sb, vid, [vid])
    finally:
        stop.set()
        a.close()
        b.close()


def test_a_verify_waits_for_the_primary_between_its_syncs(lab):
    """The primary serves its snapshot's digests only between its own syncs (``snaphashes``
    takes the unit's lock without waiting: control/consistency.py asks while holding the
    secondary's). A verify meeting the primary's unit locked, as by a sync in flight, waits
    and still compares with the primary; it does not end unchecked against it."""
    from drsvc import store
    a, b = _clients(lab)
    try:
        vid = _replicated(lab, a, "verify-held", 16 << 20)
        held, go = threading.Event(), threading.Event()

        def hold():
            with store.file_lock(PoolLayout(lab.sites["a"].pool).lock_path(vid)):
                held.set()
                go.wait(30)
        t = threading.Thread(target=hold, daemon=True)
        t.start()
        held.wait(10)
        threading.Timer(3.0, go.set).start()        # the "sync" ends 3 s into the verify
        r = b.verify(volume_id=vid, wait=120)
        t.join(30)
        assert r["result"] == "clean" and r["checked"] == {"recorded": True, "primary": True}, r
        assert not any("not compared" in n for n in r["notes"]), r
    finally:
        a.close()
        b.close()


def test_a_replica_is_verified_on_its_class_schedule(lab):
    """drsvc.io/verifyInterval reaches the DR site with the first sync: b's scheduler (a mark
    made as the first generation lands, not its hourly sweep) queues a verify every interval,
    its worker runs it, and a byte flipped afterwards is found by a later scheduled run."""
    a, b = _clients(lab)
    sb = lab.sites["b"]
    try:
        vid = _replicated(lab, a, "verify-sched", 32 << 20, params={"drsvc.io/verifyInterval": "3s"})
        # before any verify, last_time reads the first receive (what an overdue verify counts from)
        times = [b.status(volume_id=vid)["verify"]["last_time"]]
        assert b.status(volume_id=vid)["verify"]["interval_seconds"] == 3
        for what in ("a scheduled verify at b", "the next scheduled verify"):
            wait_for(lambda: b.status(volume_id=vid)["verify"]["last_time"] > times[-1], 60, what=what)
            v = b.status(volume_id=vid)["verify"]
            assert not v["failed"], v
            times.append(v["last_time"])
        off = _data_block(sb, vid) * BS + 7
        _flip(sb, vid, off)
        v = wait_for(lambda: (v := b.status(volume_id=vid)["verify"])["failed"] and v, 60,
                     what="a scheduled verify to find the flipped byte")
        assert v["mismatched_blocks"] == 1 and f"{vid}@{off - off % BS}" in v["message"], v
        st = b.status(volume_id=vid)
        assert st["status"] == "VERIFY_FAILED", st
    finally:
        a.close()
        b.close()


def _undo_row(site, vid: str, generation: int):
    """A row of the point's undo map that holds data: (volume offset, length, log position)."""
    m = undo_map(read_meta(PoolLayout(site.pool), vid, generation), vid)
    rows = m[m[:, 2] >= 0]
    assert len(rows), f"point {generation} keeps no data"
    return tuple(int(x) for x in rows[len(rows) // 2])


def test_a_flipped_byte_in_a_points_undo_log_is_found_and_a_promote_to_it_refused(lab):
    """The unit verifies itself every 3 s at b; three generations make two points with undo
    logs. One byte flipped in the older point's undo log: the scheduled verify finds it, so
    does `drsvc verify`, naming the point, the volume offset and the log offset; the status is
    VERIFY_FAILED and says the point cannot be repaired from the primary; a promote to it (or
    to an older point, built through it) is refused, a forced one goes through."""
    a, b = _clients(lab)
    sa, sb = lab.sites["a"], lab.sites["b"]
    try:
        vid = _replicated(lab, a, "verify-point", 32 << 20, params={"drsvc.io/verifyInterval": "3s"})
        for i in range(2):
            write_random(sa, vid, count=24, seed=f"pt{i}")
            a.until_done(lambda: a.sync_now(volume_id=vid, wait=60), wait=90)
        g = generation(sb, vid)
        bad_point = g - 1
        clean = b.verify(volume_id=vid, wait=120)
        assert clean["result"] == "clean" and not clean["damaged_points"] and not clean["unverifiable_points"], clean
        off, length, pos = _undo_row(sb, vid, bad_point)
        at = pos + min(length - 1, 4096 + 33)
        log = PoolLayout(sb.pool).point_undo(vid, bad_point, vid)
        with open(log, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x5A]))
        block = at - at % 4096
        expect = off + max(0, block - pos)

        v = wait_for(lambda: (v := b.status(volume_id=vid)["verify"])["failed"] and v, 60,
                     what="a scheduled verify to find the flipped byte in the point")
        assert v["damaged_points"] == 1 and v["mismatched_blocks"] == 0, v
        assert f"recovery point(s) {bad_point} damaged" in v["message"] and "cannot be repaired" in v["message"], v
        assert f"point {bad_point} {vid}@{expect}" in v["message"], v
        assert b.status(volume_id=vid)["status"] == "VERIFY_FAILED"

        code, doc = _cli_json("verify", "--endpoint", sb.endpoint, "--volume", vid, "--json")
        assert code == 1 and doc["error"]["code"] == "VERIFY_FAILED", doc
        r = doc["result"]
        assert r["mismatched_blocks"] == 0 and r["damaged_points"] == [bad_point] and r["point_bad_blocks"] == 1, r
        [m] = [m for m in r["mismatches"] if m["against"] == "point"]
        assert (m["point"], m["volume_id"], m["offset"], m["file_offset"], m["data"]) == \
            (bad_point, vid, expect, block, "undo"), m
        assert "cannot be repaired" in doc["error"]["message"], doc

        for target in (bad_point, bad_point - 1):
            with pytest.raises(RpcFailed) as e:
                b.until_done(lambda t=target: b.replication("PromoteVolume", volume_id=vid, force=False,
                                                            parameters={"drsvc.io/recoveryPoint": str(t)}), wait=60)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
            assert f"built through point {bad_point}" in e.value.message, e.value.message
        assert find_state(sb.pool, vid).role == "secondary"
        # a drill's clone: of the damaged point or one built through it, only with force; the
        # newest point is laid over the replica alone, and clones as it is
        for target in (bad_point, bad_point - 1):
            with pytest.raises(RpcFailed) as e:
                b.clone_replica(f"bad{target}", volume_id=vid, point=str(target))
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
            assert f"built through point {bad_point}" in e.value.message and "clone with force" in e.value.message
        assert b.clone_replica("newest", volume_id=vid, point=str(g))["generation"] == g
        assert b.clone_replica("look", volume_id=vid, point=str(bad_point), force=True)["generation"] == bad_point
        b.until_done(lambda: b.replication("PromoteVolume", volume_id=vid, force=True,
                                           parameters={"drsvc.io/recoveryPoint": str(bad_point)}), wait=120)
        assert find_state(sb.pool, vid).role == "primary"
    finally:
        a.close()
        b.close()
