"""bwlimit by the hour (drsvc.rate_schedule): the schedule's grammar and its errors, the rate
in force at a moment and the next change, in the site's time zone, and the local bucket that
follows it (on a fake clock: exact figures). The shared bucket in Redis following a schedule
mid-sync is measured over real syncs in tests/replication/test_bandwidth.py."""
from __future__ import annotations

from datetime import datetime

import pytest

from drsvc.config import parse
from drsvc.errors import ConfigInvalid
from drsvc.rate_schedule import RateSchedule, ScheduleInvalid, is_schedule, parse_schedule, zone
from drsvc.transport.bandwidth import LocalBandwidth, ScheduledBucket
from drsvc_cli.cmd_site import bandwidth_rows

pytestmark = pytest.mark.fast
MBIT, GBIT = 125_000, 125_000_000
BERLIN = zone("Europe/Berlin")


def rate(text: str) -> int:
    """Rates as the tests write them: "100mbit", "1gbit", or bytes per second."""
    text = text.lower()
    for unit, mult in (("gbit", GBIT), ("mbit", MBIT)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * mult)
    if not text.isdigit():
        raise ValueError(f"bad rate {text!r}")
    return int(text)


def at(text: str, tz=BERLIN) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=tz).timestamp()


OFFICE = "100mbit 08:00-20:00 Mon-Fri, 1gbit"


@pytest.mark.parametrize("moment, want", [
    ("2026-12-01 07:59:59", 1000),      # Tuesday, before office hours
    ("2026-12-01 08:00:00", 100),       # the window's start is in it
    ("2026-12-01 19:59:59", 100),
    ("2026-12-01 20:00:00", 1000),      # its end is not
    ("2026-12-05 12:00:00", 1000),      # Saturday
    ("2026-12-04 12:00:00", 100),       # Friday
])
def test_office_hours_in_the_sites_zone(moment, want):
    sch = parse_schedule(OFFICE, rate, BERLIN)
    assert sch.rate_at(at(moment)) == want * MBIT
    # the same instant read in UTC is an hour earlier in winter: the zone matters
    assert parse_schedule(OFFICE, rate).rate_at(at("2026-12-01 08:30:00")) == 1000 * MBIT


def test_first_match_wins_and_a_window_past_midnight_belongs_to_its_start_day():
    sch = parse_schedule("10mbit 12:00-13:00 Mon-Fri, 50mbit 22:00-06:00 Fri, 200mbit Sat-Sun, 0", rate, BERLIN)
    assert sch.rate_at(at("2026-12-01 12:30:00")) == 10 * MBIT           # Tuesday lunch
    assert sch.rate_at(at("2026-12-04 23:00:00")) == 50 * MBIT           # Friday night
    assert sch.rate_at(at("2026-12-05 05:59:00")) == 50 * MBIT           # its morning part is Saturday's
    assert sch.rate_at(at("2026-12-05 06:00:00")) == 200 * MBIT          # then the weekend entry
    assert sch.rate_at(at("2026-12-01 23:00:00")) == 0                   # a weekday night: no cap
    assert sch.rate_at(at("2026-12-02 05:00:00")) == 0                   # Tuesday's 22:00 is not Friday's


def test_next_change_names_the_boundary_and_the_rate():
    sch = parse_schedule(OFFICE, rate, BERLIN)
    when, new = sch.next_change(at("2026-12-04 19:00:00"))               # Friday evening
    assert (when, new) == (at("2026-12-04 20:00:00"), 1000 * MBIT)
    when, new = sch.next_change(at("2026-12-04 21:00:00"))               # then the weekend goes by
    assert (when, new) == (at("2026-12-07 08:00:00"), 100 * MBIT)
    assert parse_schedule("5mbit", rate).next_change(0) is None
    d = sch.describe(at("2026-12-04 19:00:00"))
    assert d["entry"] == "100mbit 08:00-20:00 Mon-Fri" and d["next_change"] == "2026-12-04T20:00:00+01:00"


def test_a_window_keeps_its_wall_clock_hours_across_daylight_saving():
    sch = parse_schedule(OFFICE, rate, BERLIN)
    summer, winter = at("2026-07-01 08:00:00"), at("2026-12-01 08:00:00")
    assert sch.rate_at(summer) == sch.rate_at(winter) == 100 * MBIT
    assert sch.rate_at(summer - 1) == sch.rate_at(winter - 1) == 1000 * MBIT
    # the night the clocks go forward (29 March 2026): 08:00 is still the boundary
    when, _ = sch.next_change(at("2026-03-30 01:00:00"))
    assert when == at("2026-03-30 08:00:00")


def test_seconds_and_midnight_and_days_alone():
    sch = parse_schedule("1mbit 10:00:30-24:00, 2mbit Sun, 3mbit", rate)
    assert sch.rate_at(at("2026-12-01 10:00:29", zone("UTC"))) == 3 * MBIT
    assert sch.rate_at(at("2026-12-01 10:00:30", zone("UTC"))) == 1 * MBIT
    assert sch.rate_at(at("2026-12-01 23:59:59", zone("UTC"))) == 1 * MBIT
    assert sch.rate_at(at("2026-12-06 09:00:00", zone("UTC"))) == 2 * MBIT


@pytest.mark.parametrize("text, says", [
    ("100mbit 08:00-20:00", "is the default and takes no time or days"),
    ("100mbit, 1gbit", "names no time window or days"),
    ("100mbit 08:00-20:00,, 1gbit", "empty entry"),
    ("100mbit 8-20, 1gbit", "neither a time window nor days"),
    ("100mbit 08:00-25:00, 1gbit", "is not a time of day"),
    ("100mbit 08:00-08:00, 1gbit", "is empty"),
    ("100mbit 08:00-12:00 13:00-14:00, 1gbit", "2 time windows"),
    ("100mbit Mon-Fry, 1gbit", "'Mon-Fry' is neither a time window nor days"),
    ("100mbit 08:00, 1gbit", "is not a window HH:MM-HH:MM"),
])
def test_bad_entries_are_refused_naming_the_entry(text, says):
    with pytest.raises(ScheduleInvalid, match=says):
        parse_schedule(text, rate)


def test_is_schedule_tells_a_plain_rate_from_a_schedule():
    assert not is_schedule("12.5 MiB/s") and not is_schedule("100mbit")
    assert is_schedule(OFFICE) and is_schedule("5mbit Sat") and is_schedule("5mbit 01:00-02:00")


def _doc(**top):
    return {"site": "a", "pool": "/p", **top,
            "peers": {"b": {"host": "h", "known_hosts": "k", "key": "x", "bwlimit": "10mbit 00:00-06:00, 20mbit"}}}


def test_the_config_reads_schedules_site_and_peer_in_the_sites_zone():
    cfg = parse(_doc(bwlimit=OFFICE, timezone="Europe/Berlin"))
    assert cfg.bwlimit == 125_000_000 and cfg.bwschedule.windows[0].rate == 12_500_000
    assert cfg.peers["b"].bwlimit == 2_500_000
    caps = cfg.bandwidth_caps("b", at=at("2026-12-01 09:00:00"))
    assert list(caps.items()) == [("peer:b", 2_500_000), ("site", 12_500_000)]
    assert cfg.bandwidth_caps("b", at=at("2026-12-01 05:00:00")) == {"peer:b": 1_250_000, "site": 125_000_000}
    # each rate of a schedule is checked as a plain bwlimit is
    with pytest.raises(ConfigInvalid, match=r"site config: bwlimit = '10 08:00-20:00, 1gbit'.*under the least cap"):
        parse(_doc(bwlimit="10 08:00-20:00, 1gbit"))
    with pytest.raises(ConfigInvalid, match=r"\[peers.b\]: bwlimit = .*names no time window"):
        parse({**_doc(), "peers": {"b": {"host": "h", "known_hosts": "k", "key": "x", "bwlimit": "1mbit, 2mbit"}}})
    with pytest.raises(ConfigInvalid, match="timezone 'Mars/Olympus' is not a known IANA time zone"):
        parse(_doc(bwlimit=OFFICE, timezone="Mars/Olympus"))


def test_site_status_rows_show_the_cap_now_and_the_next_change():
    cfg = parse(_doc(bwlimit=OFFICE, timezone="Europe/Berlin"))
    rows = {r["cap"]: r for r in bandwidth_rows(cfg, now=at("2026-12-04 19:00:00"))}
    assert rows["site"]["rate"] == 12_500_000 and rows["site"]["next_rate"] == 125_000_000
    assert rows["site"]["next_change"] == "2026-12-04T20:00:00+01:00"
    assert rows["peer:b"]["rate"] == 2_500_000 and rows["peer:b"]["next_change"] == "2026-12-05T00:00:00+01:00"


class Clock:
    """Fake monotonic and wall clocks together; sleep advances both."""

    def __init__(self, wall: float):
        self.mono, self.wall = 0.0, wall

    def sleep(self, s: float) -> None:
        self.mono += s
        self.wall += s


def test_a_local_bucket_changes_rate_at_the_boundary_mid_stream():
    c = Clock(at("2026-12-01 19:59:50"))
    sch = parse_schedule("1mbit 08:00-20:00, 4mbit", rate, BERLIN)
    b = ScheduledBucket(sch, wall=lambda: c.wall, clock=lambda: c.mono, sleep=c.sleep)
    sent_before = 0
    while c.wall < at("2026-12-01 20:00:00"):
        b.take(64 << 10)
        sent_before += 64 << 10
    t0 = c.mono
    for _ in range(200):
        b.take(64 << 10)
    after = 200 * (64 << 10) / (c.mono - t0)
    # ten seconds at 1 Mbit (plus the first burst), then the new rate within a send
    assert abs(sent_before - 10 * MBIT) <= 3 * (64 << 10)
    assert 0.97 <= after / (4 * MBIT) <= 1.03
    assert b.rate == 4 * MBIT


def test_an_hour_without_a_cap_passes_sends_through():
    c = Clock(at("2026-12-01 23:00:00"))
    b = ScheduledBucket(parse_schedule("1mbit 08:00-20:00, 0", rate, BERLIN),
                        wall=lambda: c.wall, clock=lambda: c.mono, sleep=c.sleep)
    for _ in range(1000):
        b.take(64 << 10)
    assert c.mono == 0 and b.rate == 0


def test_local_caps_take_plain_rates_or_schedules_and_share_one_bucket():
    sch = RateSchedule.constant(2 * MBIT)
    local = LocalBandwidth(lambda peer: {"site": sch})
    assert local.limiter("u1", "b") is local.limiter("u2", "c")
    assert local.bucket("site", 8 * MBIT, share=4).rate == 2 * MBIT
