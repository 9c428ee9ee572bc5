"""The pure parts of a verify (drsvc.replication.control.scrub_plan, verify_record) and the
settings it reads: window planning, the read rate cap, the comparison of a window's digests,
the findings, the verdict the status gives, interval parsing."""
from __future__ import annotations

import os

import pytest

from drsvc.config import parse
from drsvc.errors import ConfigInvalid, InvalidParameter
from drsvc.replication.common.blockmap import DIGEST, ZERO, block_count, digest_blocks, hash_image, hash_range
from drsvc.replication.common.read_pacer import ReadPacer
from drsvc.replication.control.scrub_plan import REPAIR_RUNS, Findings, compare_window, plan_windows
from drsvc.replication.control.verify_record import judge, point_known_bad
from drsvc.schedule import parse_verify_interval

pytestmark = pytest.mark.fast


def _d(*tags: int) -> bytes:
    """Slots whose digests are distinct per tag (tag 0: the zero digest)."""
    return b"".join(ZERO if t == 0 else bytes([t]) * DIGEST for t in tags)


@pytest.mark.parametrize("size,bs,window", [(0, 4096, 1 << 20), (1, 4096, 1 << 20), (10 << 20, 4096, 1 << 20),
                                            ((10 << 20) + 5, 4096, 3 << 20), (8192, 4096, 100)])
def test_windows_cover_every_block_once_in_order(size, bs, window):
    w = plan_windows(size, bs, window)
    covered = [b for first, n in w for b in range(first, first + n)]
    assert covered == list(range(block_count(size, bs)))
    assert all(0 < n <= max(1, window // bs) for _, n in w)


def test_the_pacer_holds_the_average_rate_and_is_free_without_a_cap():
    now = [100.0]
    p = ReadPacer(10 << 20, clock=lambda: now[0])
    assert p.delay(5 << 20) == pytest.approx(0.5)       # 5 MiB at 10 MiB/s: 0.5 s from the start
    now[0] += 0.5
    assert p.delay(5 << 20) == pytest.approx(0.5)
    now[0] += 3.0                                       # a slow read: the budget is spent, no wait
    assert p.delay(1 << 20) == 0.0
    assert p.done == 11 << 20
    free = ReadPacer(0, clock=lambda: now[0])
    assert free.delay(1 << 30) == 0.0


def test_a_window_against_the_recorded_map_and_the_primary():
    actual = _d(1, 2, 9, 4)
    v = compare_window(actual, recorded=_d(1, 2, 3, 4), primary=_d(1, 2, 3, 5))
    assert v.against_recorded.tolist() == [2]
    assert v.against_primary.tolist() == [2, 3]
    assert v.bad.tolist() == [2, 3] and v.rewritten.tolist() == []


def test_blocks_a_sync_rewrote_meanwhile_are_held_to_the_new_map_only():
    # the verify began at generation G (start map); a sync rewrote block 1 since (recorded map now)
    start, now_map, primary_g = _d(1, 2, 3), _d(1, 7, 3), _d(1, 2, 3)
    v = compare_window(_d(1, 7, 3), recorded=now_map, primary=primary_g, start=start)
    assert v.bad.tolist() == [] and v.rewritten.tolist() == [1]
    # ... and a rewritten block that is not what the sync applied is still found
    v = compare_window(_d(1, 8, 3), recorded=now_map, primary=primary_g, start=start)
    assert v.against_recorded.tolist() == [1] and v.against_primary.tolist() == []
    with pytest.raises(ValueError):
        compare_window(_d(1), recorded=None, primary=_d(1), start=_d(1))


def test_without_a_primary_only_the_recorded_map_is_checked():
    v = compare_window(_d(1, 2), recorded=_d(1, 3))
    assert v.against_recorded.tolist() == [1] and v.against_primary.tolist() == []
    assert compare_window(_d(1, 2)).bad.tolist() == []


def test_findings_count_every_block_and_name_the_first_ranges_joined():
    f = Findings()
    v = compare_window(_d(9, 9, 1, 9), recorded=_d(1, 1, 1, 1), primary=_d(1, 1, 1, 1))
    f.add("vol-a", 10, 1 << 20, 4096, v, recorded_generation=7, primary_generation=7)
    assert f.blocks == 3
    assert f.named == [{"volume": "vol-a", "offset": 10 * 4096, "length": 2 * 4096, "against": "both",
                        "generation": 7},
                       {"volume": "vol-a", "offset": 13 * 4096, "length": 4096, "against": "both", "generation": 7}]
    for i in range(40):
        f.add("vol-b", 2 * i, 1 << 30, 4096, compare_window(_d(9), recorded=_d(1)),
              recorded_generation=8, primary_generation=7)
    assert f.blocks == 43 and len(f.named) == 16


def test_findings_keep_every_run_for_a_repair_until_too_many():
    """The repair names every differing run (not only the first 16 the record names), joined
    where blocks follow each other; past REPAIR_RUNS runs, or a member compared whole, there
    is no list and the repair is a compare sync."""
    f = Findings()
    f.add("a", 10, 1 << 20, 4096, compare_window(_d(9, 9, 1, 9), recorded=_d(1, 1, 1, 1)),
          recorded_generation=7, primary_generation=7)
    for i in range(40):
        f.add("b", 2 * i, 1 << 30, 4096, compare_window(_d(9), recorded=_d(1)),
              recorded_generation=8, primary_generation=7)
    assert f.runs["a"] == [[10 * 4096, 2 * 4096], [13 * 4096, 4096]]
    assert f.runs["b"] == [[2 * i * 4096, 4096] for i in range(40)]
    many = Findings()
    for i in range(REPAIR_RUNS + 1):
        many.add("v", 2 * i, 1 << 40, 4096, compare_window(_d(9), recorded=_d(1)),
                 recorded_generation=3, primary_generation=3)
    assert many.runs is None and many.blocks == REPAIR_RUNS + 1
    whole = Findings()
    whole.whole("v", 1 << 20, 4096, "primary", 3, "absent")
    assert whole.runs is None


def test_the_last_short_block_is_named_with_its_length():
    f = Findings()
    f.add("v", 2, 2 * 4096 + 100, 4096, compare_window(_d(9), recorded=_d(1)), recorded_generation=3,
          primary_generation=3)
    assert f.named[0]["offset"] == 8192 and f.named[0]["length"] == 100


def test_hash_range_is_the_scan_digests_of_its_window(tmp_path):
    path = tmp_path / "img"
    bs, size = 4096, (3 << 20) + 1000
    with open(path, "wb") as fh:
        fh.truncate(size)
        fh.seek(5 * bs + 7)
        fh.write(os.urandom(3 * bs))
        fh.seek(size - 500)
        fh.write(b"x" * 500)
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = bytearray(block_count(size, bs) * DIGEST)
        for first, digests in hash_image(fd, size, bs):
            whole[first * DIGEST:first * DIGEST + len(digests)] = digests
        buf = bytearray(64 << 10)
        got = b"".join(hash_range(fd, first, n, bs, size, buf)[0] for first, n in plan_windows(size, bs, 256 << 10))
        assert got == bytes(whole)
        digests, nread = hash_range(fd, 0, 16, bs, size, buf)
        assert digests[5 * DIGEST:6 * DIGEST] == digest_blocks(os.pread(fd, bs, 5 * bs), bs)
        assert 0 < nread <= 16 * bs
    finally:
        os.close(fd)


FAIL = {"generation": 5, "mismatched_blocks": 2, "result": "mismatch",
        "mismatches": [{"volume": "vol-a", "offset": 4096, "length": 4096, "against": "primary", "generation": 5}]}


def test_a_failure_stands_until_a_repair_commits_a_newer_generation():
    v = judge({"failure": FAIL, "last_complete_at": 50.0}, generation=5, repair_asked=False)
    assert v["failed"] and v["mismatched_blocks"] == 2 and v["generation"] == 5
    assert "vol-a@4096" in v["message"] and "--repair" in v["message"]
    # a later ordinary sync does not clear it: the bad block may be one it did not touch
    assert judge({"failure": FAIL}, generation=6, repair_asked=False)["failed"]
    asked = {"failure": FAIL, "repair": {"requested_at": 60.0, "generation": 5}}
    v = judge(asked, generation=5, repair_asked=True)
    assert v["failed"] and v["repair_pending"] and "waiting for the primary's compare sync" in v["message"]
    v = judge(asked, generation=6, repair_asked=False)
    assert not v["failed"] and v["repaired"] and v["message"] == ""
    assert not judge({}, generation=3, repair_asked=False)["failed"]


POINTS = {"damaged_points": [7], "bad_blocks": 1, "unverifiable": [{"point": 3, "volume": "vol-a", "bytes": 8192}],
          "damaged": [{"volume": "vol-a", "offset": 1 << 20, "length": 4096, "against": "point", "point": 7,
                       "generation": 7, "data": "undo", "file_offset": 8192}]}


def test_a_damaged_point_fails_the_verify_past_a_repair_and_bars_promotes_through_it():
    v = judge({"points": POINTS}, generation=9, repair_asked=False)
    assert v["failed"] and not v["replica_failed"] and v["damaged_points"] == [7] and v["unverifiable_points"] == [3]
    assert "point 7 vol-a@1048576" in v["message"] and "cannot be repaired" in v["message"]
    assert v["message"].startswith("VERIFY_FAILED: recovery point(s) 7 damaged")
    # a repair of the replica clears its failure, not the point's damage
    both = {"failure": FAIL, "repair": {"requested_at": 60.0, "generation": 5}, "points": POINTS}
    v = judge(both, generation=6, repair_asked=False)
    assert v["repaired"] and not v["replica_failed"] and v["failed"] and "recovery point(s) 7" in v["message"]
    # an image of point 7 or older is built through 7; a newer one, or the replica, is not
    assert [point_known_bad(v, g) for g in (5, 7, 8)] == [7, 7, None]
    clean = judge({"points": {**POINTS, "damaged_points": [], "damaged": []}}, generation=9, repair_asked=False)
    assert not clean["failed"] and clean["message"] == "" and clean["unverifiable_points"] == [3]


def test_verify_intervals_parse_like_sync_intervals_up_to_ninety_days():
    assert parse_verify_interval("168h") == 7 * 86400
    assert parse_verify_interval("90d") == 90 * 86400
    assert parse_verify_interval("0") == 0 and parse_verify_interval("off") == 0
    for bad in ("91d", "1w", "-1h", "h"):
        with pytest.raises(InvalidParameter) as e:
            parse_verify_interval(bad)
        assert e.value.fields["key"] == "drsvc.io/verifyInterval"


def test_site_verify_settings(tmp_path):
    base = {"site": "b", "pool": str(tmp_path)}
    cfg = parse(base)
    assert (cfg.verify_interval, cfg.verify_read_rate, cfg.verify_repair) == (7 * 86400, 0, False)
    cfg = parse({**base, "verify_interval": "24h", "verify_read_rate": "100MiB/s", "verify_repair": True})
    assert (cfg.verify_interval, cfg.verify_read_rate, cfg.verify_repair) == (86400, 100 << 20, True)
    assert parse({**base, "verify_interval": "0"}).verify_interval == 0
    for bad in ({"verify_interval": "1y"}, {"verify_read_rate": "fast"}, {"verify_repair": "yes"}):
        with pytest.raises(ConfigInvalid):
            parse({**base, **bad})
