"""bench.goals judges the bench's goals from the bench's JSON line: thresholds and edges."""
from __future__ import annotations

import pytest

from bench.goals import judge, table

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def case(name, drsvc, rsync=None, floor=None, changed=10 << 20, wire=None, freeze=0.01):
    runs = drsvc if isinstance(drsvc, list) else [drsvc]
    med = sorted(runs)[len(runs) // 2]
    return {"name": name, "changed_bytes": changed, "drsvc_wire_bytes": wire or changed,
            "drsvc_s": {"best": min(runs), "median": med, "runs": runs},
            "rsync_s": {"best": rsync, "median": rsync, "runs": [rsync]} if rsync else None,
            "floor_s": {"best": floor, "median": floor, "runs": [floor]} if floor else None,
            "ratio": round(rsync / med, 2) if rsync else None,
            "drsvc_phases": [{"freeze_s": freeze}], "drsvc_phases_median": {"freeze_s": freeze},
            "peak_rss_bytes": {"sender": 1, "receiver": 1}}


def verdicts(doc):
    return {name: ok for name, _, ok in judge(doc)}


def test_floor_goal_and_wire():
    doc = {"cold": True, "cases": [case("1pct", 0.425, 2.0, floor=0.25, wire=int(1.05 * (10 << 20)))],
           "peak_rss_bytes": {"sender": 149e6, "receiver": 20e6}}
    v = verdicts(doc)
    assert v["1pct cold: <= 1.5 x floor_s + 50 ms"] is True          # exactly on the line
    assert v["1pct: wire <= 1.05 x changed"] is True
    assert v["peak RSS < 150 MB (sender, receiver)"] is True
    doc["cases"][0]["drsvc_s"]["median"] = 0.426
    doc["peak_rss_bytes"]["sender"] = 151e6
    v = verdicts(doc)
    assert v["1pct cold: <= 1.5 x floor_s + 50 ms"] is False
    assert v["peak RSS < 150 MB (sender, receiver)"] is False


def test_ratio_speed_growth_thin_idle_freeze():
    doc = {"cold": True, "cases": [
        case("full", 2.5, 8.4, floor=0.6, changed=1 << 30),
        case("10pct", [1.0, 1.1, 1.3], 8.0, floor=0.7),
        case("thin", 0.51, 33.0, floor=0.1),
        case("idle", 0.029, 0.3, freeze=0.101)]}
    v = verdicts(doc)
    assert v["full: >= 2 x rsync"] is True and v["full: >= 400 MB/s"] is True    # 429 MB/s
    assert v["10pct: >= 6 x rsync"] is True and v["10pct: run 3 <= 1.2 x run 1"] is False
    assert v["thin: <= 0.5 s"] is False
    assert v["idle: <= 30 ms"] is True and v["idle: freeze <= 100 ms"] is False
    assert "1pct warm: >= 12 x rsync" not in v                                   # not run: not judged
    assert table(doc).count("\n") == 1 + len(doc["cases"])


def test_warm_ratio():
    v = verdicts({"cold": False, "cases": [case("1pct", 0.1, 1.19)]})
    assert v["1pct warm: >= 12 x rsync"] is False
    assert "1pct cold: <= 1.5 x floor_s + 50 ms" not in v


def test_ceilings_are_shown_beside_the_goals_they_bound():
    full = case("full", 5.0, 6.0, floor=0.6, changed=1 << 30)
    full["channel"] = {"bytes": 1, "drsvc_mb_s": 250.0, "openssh_mb_s": 330.0, "disk_write_mb_s": 140.0,
                       "runs": {}}
    aged = case("aged", 0.9, 5.0, floor=0.3)
    aged["extent_costs"] = {"extents": 108824, "fiemap_s": 0.36, "ranges_cloned": 2560,
                            "precopy_us_per_range": 160.0, "adopt_us_per_range": 80.0}
    got = {name: text for name, text, _ in judge({"cold": True, "cases": [full, aged]})}
    assert got["full: >= 400 MB/s"] == (
        "215 MB/s (an SSH channel alone: 250 MB/s drsvc's, 330 MB/s OpenSSH's; the peer's pool writes 140 MB/s)")
    assert got["aged cold: <= 1.5 x floor_s + 50 ms"].endswith(
        "[image of 108824 extents, one FIEMAP 0.360 s, 2560 ranges cloned at <= 160 us (capture) "
        "and 80 us (the base roll) each]")
    assert verdicts({"cold": True, "cases": [full, aged]})["full: >= 400 MB/s"] is False


def linked(c, *, rtt=0.1, rate=125e6, rsync=None):
    """A case as a --link run reports it: its floors over the link (bench.wan.add_floors)."""
    floor = c["drsvc_wire_bytes"] / rate + rtt
    data = c["changed_bytes"] / rate + rtt
    c["link"] = {"rtt_s": rtt, "rate_bytes_s": rate, "spec": "rtt=100ms,rate=1000mbit",
                 "floor_s": {"best": floor, "median": floor, "runs": [floor]},
                 "data_floor_s": {"best": data, "median": data, "runs": [data]},
                 "x_floor": round(c["drsvc_s"]["median"] / floor, 2),
                 "rsync_x_floor": round(rsync / floor, 2) if rsync else None}
    return c


def wan_doc(*cases):
    return {"cold": True, "link": {"spec": "rtt=100ms,rate=1000mbit", "rtt_s": 0.1, "rate_bytes_s": 125e6,
                                   "queue_bytes": 13_500_000}, "cases": list(cases)}


def test_wan_goals_are_judged_against_the_floor_over_the_link():
    gib = 1 << 30
    full = linked(case("full", gib / (0.85 * 125e6), 60.0, floor=0.6, changed=gib))    # exactly 85% of the link
    onepct = linked(case("1pct", 1.2 * ((10 << 20) / 125e6 + 0.1), 5.0, floor=0.3))    # exactly 1.2 x floor
    idle = linked(case("idle", 8192 / 125e6 + 0.1 + 0.1, changed=8192))               # floor + 1 RTT
    fo = linked(case("failover", (8 << 20) / 125e6 + 0.1 + 0.2, changed=8 << 20))      # floor + 2 RTT
    db = linked(case("dbpages", (20 << 20) / 125e6 + 0.1, 3.0, changed=20 << 20, wire=10 << 20))  # = raw floor
    v = verdicts(wan_doc(full, onepct, idle, fo, db))
    assert v["full: >= 85% of the link rate"] is True
    assert v["1pct: <= 1.2 x floor"] is True
    assert v["idle: <= floor + 1 RTT"] is True and v["failover: <= floor + 2 RTT"] is True
    assert v["dbpages: < the uncompressed floor"] is False        # equal to it is not below it
    assert "full: >= 400 MB/s" not in v and "1pct cold: <= 1.5 x floor_s + 50 ms" not in v   # LAN goals: LAN only
    assert v["full: freeze <= 100 ms"] is True                                            # judged on any link
    for c in (full, onepct, idle, fo):
        c["drsvc_s"]["median"] *= 1.01
    db["drsvc_s"]["median"] *= 0.99
    v = verdicts(wan_doc(full, onepct, idle, fo, db))
    assert not any(v[k] for k in ("full: >= 85% of the link rate", "1pct: <= 1.2 x floor",
                                  "idle: <= floor + 1 RTT", "failover: <= floor + 2 RTT"))
    assert v["dbpages: < the uncompressed floor"] is True


def test_wan_table_and_summary_have_a_row_per_case():
    from bench.goals import summary
    doc = wan_doc(linked(case("1pct", 0.5, 2.0, floor=0.3), rsync=2.0), linked(case("idle", 0.3, changed=8192)))
    assert table(doc).count("\n") == 1 + 2 and "floor (wire / rate + RTT)" in table(doc)
    rows = summary([doc, doc]).splitlines()
    assert len(rows) == 2 + 4 and rows[2].startswith("| rtt=100ms,rate=1000mbit | 1pct | 0.500 s")
