from collections import Counter

import pytest

from drsvc.schedule import assess, catch_up, parse_interval, phase, slot_at_or_before
from drsvc.errors import InvalidParameter


def test_intervals():
    assert parse_interval("30s") == 30 and parse_interval("1h30m") == 5400 and parse_interval("90") == 90
    for bad in ("", "5x", "0s", "8d", "1h 2m"):
        with pytest.raises(InvalidParameter):
            parse_interval(bad)


def test_health():
    h = assess(now=100, interval=10, enabled_at=95, last_success=0, consecutive_failures=0, last_error="")
    assert h.status == "UNKNOWN"
    h = assess(now=100, interval=10, enabled_at=50, last_success=0, consecutive_failures=0, last_error="")
    assert h.status == "DEGRADED" and h.lag_seconds == 50
    h = assess(now=100, interval=10, enabled_at=50, last_success=95, consecutive_failures=0, last_error="")
    assert h.status == "HEALTHY"
    h = assess(now=100, interval=10, enabled_at=50, last_success=95, consecutive_failures=2, last_error="boom")
    assert h.status == "DEGRADED" and "boom" in h.message
    h = assess(now=100, interval=10, enabled_at=0, last_success=95, consecutive_failures=0, last_error="",
               conflict="split brain")
    assert h.status == "ERROR"
    # promoted again at 90 after a previous term that last synced at 20: pending, not behind
    h = assess(now=100, interval=10, enabled_at=90, last_success=20, consecutive_failures=0, last_error="")
    assert h.status == "UNKNOWN" and h.lag_seconds == 10


def test_phases_spread_units_over_the_interval():
    """N units with one interval are spread over it by a hash of the unit id
    (not all fired at once), and every scheduler computes the same phase."""
    interval = 60
    phases = [phase(f"vol-{i:06d}", interval) for i in range(6000)]
    assert all(0 <= p < interval for p in phases)
    assert phases == [phase(f"vol-{i:06d}", interval) for i in range(6000)]     # deterministic
    buckets = Counter(int(p // 6) for p in phases)            # ten 6-second buckets, 600 expected each
    assert len(buckets) == 10 and min(buckets.values()) > 450 and max(buckets.values()) < 750, buckets
    # a schedulingStartTime sets the phase
    assert phase("vol-x", 60, start_time=1_000_000_017.5) == pytest.approx(1_000_000_017.5 % 60)


def test_slot_and_catch_up():
    assert slot_at_or_before(1000.0, 60, 7.0) == 967.0
    assert slot_at_or_before(967.0, 60, 7.0) == 967.0
    # runs missed while no leader was up: replayed in due order, at the pace they were due
    new = catch_up([("c", 130.0, 60), ("a", 100.0, 60), ("b", 112.5, 60)], now=200.0)
    assert list(new) == ["a", "b", "c"]
    assert new == {"a": 200.0, "b": 212.5, "c": 230.0}
    assert catch_up([], now=1.0) == {}
    # a long outage (a daily unit missed hours ago beside 60 s units) is compressed into the
    # shortest interval: no unit waits an hour for its replay
    new = catch_up([("daily", 0.0, 86400), ("m1", 7000.0, 60), ("m2", 7200.0, 60)], now=10_000.0)
    assert list(new) == ["daily", "m1", "m2"]
    assert new["daily"] == 10_000.0 and new["m2"] == pytest.approx(10_060.0)
    assert 10_000.0 < new["m1"] < new["m2"]
