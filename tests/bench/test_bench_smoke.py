"""Smoke tests of the bench's code paths (bench/), with tiny sizes and one run each.

They check what the bench reports, never how fast: the JSON shape bench.goals reads
for (cases with drsvc_s/rsync_s/floor_s as best/median/runs, changed_bytes,
drsvc_wire_bytes, a top-level cold flag), that every figure is positive, and that
each replica (and rsync's copy) ends up byte for byte equal to its source.
"""
from __future__ import annotations

import json
import random
import subprocess

import pytest

from bench import delta_vs_rsync
from bench.floor import coalesce, read_ranges
from bench.harness import write_random
from bench.site import Cold, backing_file
from tests.fixtures.xfs import loop_mounted_fs

pytestmark = pytest.mark.bench


def run_bench(capsys, *argv) -> dict:
    assert delta_vs_rsync.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def check_times(stat, runs: int) -> None:
    assert set(stat) == {"best", "median", "runs"}
    assert len(stat["runs"]) == runs
    assert all(x > 0 for x in stat["runs"])
    assert stat["best"] == min(stat["runs"]) and stat["best"] <= stat["median"] <= max(stat["runs"])


def check_case(c: dict, *, runs: int, cold: bool, rsync: bool = True, random_data: bool = True) -> None:
    check_times(c["drsvc_s"], runs)
    if rsync:
        check_times(c["rsync_s"], runs)
        assert c["rsync_wire_bytes"] > 0 and c["ratio"] > 0
    if cold:
        for k in ("floor_s", "floor_exact_s", "floor_readahead_s"):
            check_times(c[k], runs)
        for i in range(runs):      # the floor is the faster of the two reads of the changed blocks
            assert c["floor_s"]["runs"][i] == min(c["floor_exact_s"]["runs"][i], c["floor_readahead_s"]["runs"][i])
    else:
        assert c["floor_s"] is None and c["floor_exact_s"] is None
    assert c["changed_bytes"] > 0
    if random_data:
        assert c["drsvc_wire_bytes"] >= c["changed_bytes"]      # random data: nothing compresses
    assert len(c["drsvc_phases"]) == runs and all(c["drsvc_phases"])
    assert all(v >= 0 for v in c["drsvc_phases_median"].values())
    assert {"capture_s", "plan_s", "stream_s"} <= set(c["drsvc_phases_median"])
    assert c["peak_rss_bytes"]["sender"] > 0 and c["peak_rss_bytes"]["receiver"] > 0
    assert c["replica_matches_source"] is True


def test_coalesce_merges_adjacent_blocks_in_offset_order():
    assert coalesce([8192, 0, 4096, 20480, 20480]) == [(0, 12288), (20480, 4096)]
    assert coalesce([]) == []


def test_cold_evicts_the_files_and_the_loop_backing_file():
    """After Cold(), neither a file in the bench's XFS nor the loop device's backing file
    has a page in the page cache (fincore), so floor and syncs really read from disk."""
    with loop_mounted_fs("1G") as mnt:
        f = mnt / "data.img"
        write_random(f, 8 << 20, random.Random(1))
        assert read_ranges(f, [(0, 8 << 20)]) == 8 << 20

        def resident(path) -> int:
            out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], check=True,
                                 capture_output=True, text=True).stdout
            return int(out.split()[0])
        assert resident(f) > 0
        Cold([mnt], [backing_file(mnt)])()
        assert resident(f) == 0
        assert resident(backing_file(mnt)) == 0


def test_pool_cases_cold(capsys):
    doc = run_bench(capsys, "--size-gib", "0.03125", "--thin-gib", "0.0625", "--thin-mib", "4",
                    "--aged-rounds", "3", "--idle-mib", "16", "--idle-syncs", "2", "--repeat", "1",
                    "--channel-mib", "8", "--cases", "full,1pct,10pct,thin,aged,idle")
    assert doc["cold"] is True and doc["repeat"] == 1
    cases = {c["name"]: c for c in doc["cases"]}
    assert list(cases) == ["full", "1pct", "10pct", "thin", "aged", "idle"]
    for name in ("full", "1pct", "10pct", "thin", "aged"):
        check_case(cases[name], runs=1, cold=True)
    assert cases["full"]["changed_bytes"] == 32 << 20
    assert cases["thin"]["changed_bytes"] == 4 << 20
    aging = cases["aged"]["aging"]
    assert aging["rounds"] == 3 and len(aging["capture_plus_plan_s"]) == 3
    assert aging["extents"]["aged"] > aging["extents"]["start"]      # the rewrites fragmented it
    assert aging["first_round"]["capture_s"] > 0 and aging["last_round"]["plan_s"] > 0
    ch = cases["full"]["channel"]                 # the channels alone, measured beside the full copy
    assert ch["bytes"] == 8 << 20 and ch["drsvc_mb_s"] > 0 and ch["openssh_mb_s"] > 0 and ch["disk_write_mb_s"] > 0
    assert len(ch["runs"]["drsvc"]) == len(ch["runs"]["openssh"]) == len(ch["runs"]["disk_write"]) == 1
    for name in ("1pct", "10pct", "aged"):        # the kernel work of the delta cases
        ec = cases[name]["extent_costs"]
        assert ec["extents"] > 0 and ec["fiemap_s"] > 0 and ec["ranges_cloned"] > 0
        assert ec["precopy_us_per_range"] > 0 and ec["adopt_us_per_range"] > 0
    assert cases["aged"]["extent_costs"]["extents"] >= aging["extents"]["aged"]   # one more 1% round
    check_case(cases["idle"], runs=2, cold=False)                      # idle is warm by definition
    assert cases["idle"]["changed_bytes"] == 8192


def test_warm_mode(capsys):
    doc = run_bench(capsys, "--warm", "--size-gib", "0.015625", "--repeat", "1", "--cases", "1pct")
    assert doc["cold"] is False and doc["drop_caches"] is None
    cases = {c["name"]: c for c in doc["cases"]}
    assert list(cases) == ["full", "1pct"]           # the full copy seeds the delta cases
    for c in cases.values():
        check_case(c, runs=1, cold=False)


def test_many_through_celery(capsys):
    doc = run_bench(capsys, "--many-count", "3", "--many-mib", "16", "--idle-syncs", "2", "--repeat", "1",
                    "--cases", "many")
    cases = {c["name"]: c for c in doc["cases"]}
    assert list(cases) == ["many", "idle_celery"]
    many = cases["many"]
    check_case(many, runs=1, cold=True)
    assert many["units"] == 3 and many["worker_concurrency"] == 1
    assert many["per_sync_worker_s"]["syncs"] == 3
    check_times(many["syncs_per_s"], 1)
    assert many["changed_bytes"] == 3 * int((16 << 20) // 4096 * 0.01) * 4096
    check_case(cases["idle_celery"], runs=2, cold=False, rsync=False)
    check_times(cases["idle_celery"]["worker_job_s"], 2)


def check_link(c: dict, spec: dict) -> None:
    """A case over the link carries its floors (wire / rate + RTT, changed / rate + RTT) and ratios."""
    lk = c["link"]
    assert lk["rtt_s"] == spec["rtt_s"] and lk["rate_bytes_s"] == spec["rate_bytes_s"]
    assert lk["floor_s"]["median"] >= spec["rtt_s"] and lk["data_floor_s"]["median"] >= spec["rtt_s"]
    assert abs(lk["data_floor_s"]["best"] - (c["changed_bytes"] / spec["rate_bytes_s"] + spec["rtt_s"])) < 1e-3
    assert lk["x_floor"] == pytest.approx(c["drsvc_s"]["median"] / lk["floor_s"]["median"], rel=0.01)
    assert lk["x_floor"] >= 1          # nothing crosses the emulated link faster than its floor
    assert c["replica_matches_source"] is True


def test_over_a_link(capsys):
    """--link: every WAN case with tiny sizes, site a reaching b through the emulator."""
    doc = run_bench(capsys, "--link", "rtt=20ms,rate=200mbit", "--size-gib", "0.03125", "--full-mib", "8",
                    "--idle-mib", "16", "--idle-syncs", "2", "--db-mib", "8", "--many-count", "2",
                    "--many-mib", "16", "--failover-volume-mib", "16", "--failover-mib", "2", "--repeat", "1",
                    "--channel-mib", "8")
    spec = doc["link"]
    assert spec["spec"] == "rtt=20ms,rate=200mbit" and spec["rate_bytes_s"] == 25e6
    assert spec["queue_bytes"] == int(25e6 * 0.02) + (1 << 20)
    cases = {c["name"]: c for c in doc["cases"]}
    assert list(cases) == ["full", "1pct", "idle", "dbpages", "many", "idle_celery", "failover"]
    for c in cases.values():
        check_link(c, spec)
    for name in ("full", "1pct", "dbpages", "many"):
        check_case(cases[name], runs=1, cold=True, random_data=name != "dbpages")
        assert cases[name]["link"]["rsync_x_floor"] > 0
    assert cases["full"]["changed_bytes"] == 8 << 20                # --full-mib, apart from the 32 MiB image
    assert cases["1pct"]["changed_bytes"] == int((32 << 20) // 4096 * 0.01) * 4096
    wc = cases["full"]["wan_ceilings"]
    assert wc["link_mib_s"] == round(25e6 / (1 << 20), 1) and wc["emulator_mib_s"] > 0
    assert set(wc["paramiko_mib_s"]) == {"1", "8"} and all(v > 0 for v in wc["paramiko_mib_s"].values())
    db = cases["dbpages"]
    assert db["changed_bytes"] == int(8 * 128 * 0.1) * 8192
    assert db["drsvc_wire_bytes"] < 0.8 * db["changed_bytes"]      # the pages compress (about 2:1)
    fo = cases["failover"]
    assert fo["changed_bytes"] == 2 << 20 and fo["drsvc_wire_bytes"] >= 2 << 20
    ph = fo["drsvc_phases"][0]
    assert ph["demote_s"] > 0 and ph["promote_s"] > 0
    assert abs(fo["drsvc_s"]["median"] - ph["demote_s"] - ph["promote_s"]) < 1e-3


def test_db_pages_compress_about_two_to_one():
    import zstandard

    from bench.dbpages import PAGE, page
    rnd = random.Random(3)
    pages = [page(rnd, n, 7) for n in range(32)]
    assert {len(p) for p in pages} == {PAGE} and len(set(pages)) == 32
    ratio = 32 * PAGE / len(zstandard.ZstdCompressor(level=1).compress(b"".join(pages)))
    assert 1.8 <= ratio <= 2.3
    again = page(random.Random(3), 0, 8)
    assert again[:4096] != pages[0][:4096] and again[4096:] != pages[0][4096:]    # a new version changes both blocks
