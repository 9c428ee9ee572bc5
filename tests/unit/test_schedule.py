from drsvc.schedule import assess, parse_interval
import pytest
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
