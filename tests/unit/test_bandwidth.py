"""Bandwidth limits, the pure parts: the ``bwlimit`` parser, the caps a sync is under, and
the arithmetic of the local bucket and of the composite (drsvc.transport.bandwidth).

The buckets run on a fake clock here (a collaborator: ``sleep`` advances it), so the
figures are exact; the shared bucket in Redis and its priority are tested on a real
redis-server and real syncs in tests/replication/test_bandwidth.py."""
from __future__ import annotations

import threading

import pytest

from drsvc.config import parse, parse_bwlimit
from drsvc.errors import ConfigInvalid
from drsvc.transport.bandwidth import AllOf, LocalBandwidth, TokenBucket, combine
from workers.bandwidth import GRANT_MAX, GRANT_MIN, grant_size

pytestmark = pytest.mark.fast
KiB, MiB = 1 << 10, 1 << 20


# -- the parser -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, rate", [
    (0, 0), ("0", 0), (8 * MiB, 8 * MiB), ("8388608", 8 * MiB),
    ("100mbit", 12_500_000), ("1gbit", 125_000_000), ("512kbit", 64_000), ("1.5gbit", 187_500_000),
    ("50MiB/s", 50 * MiB), ("50mib/s", 50 * MiB), (" 12.5 MiB/s ", int(12.5 * MiB)), ("64KiB/s", 64 * KiB),
    ("1GiB/s", 1 << 30), ("1048576B/s", MiB), ("800000bit", 100_000),
])
def test_rates_parse_to_bytes_per_second(value, rate):
    assert parse_bwlimit(value, "site.toml") == rate


@pytest.mark.parametrize("value, says", [
    ("100", "was a unit left out"), (100, "was a unit left out"), ("500kbit", "under the least cap"),
    ("10 mb/s", "expected a number and a unit"),      # megabits or megabytes? refused, not guessed
    ("100MB/s", "expected a number and a unit"), ("fast", "expected a number and a unit"),
    ("-5mbit", "expected a number and a unit"), ("1e9", "expected a number and a unit"),
    (-1, "negative"), (True, "an integer"), (1.5, "an integer"), ([1], "an integer"),
])
def test_bad_rates_are_refused_naming_the_key(value, says):
    with pytest.raises(ConfigInvalid) as e:
        parse_bwlimit(value, "site.toml")
    assert "site.toml" in str(e.value) and "bwlimit" in str(e.value) and says in str(e.value)


def _doc(**top):
    return {"site": "a", "pool": "/p", **top,
            "peers": {"b": {"host": "h", "known_hosts": "k", "key": "x"},
                      "c": {"host": "h", "known_hosts": "k", "key": "x", "bwlimit": "10mbit"}}}


def test_site_and_peer_caps_from_the_config():
    cfg = parse(_doc(bwlimit="100mbit"))
    assert cfg.bwlimit == 12_500_000 and cfg.peers["c"].bwlimit == 1_250_000 and cfg.peers["b"].bwlimit == 0
    # the peer's cap first, then the site's: a sync takes from each in this order
    assert list(cfg.bandwidth_caps("c").items()) == [("peer:c", 1_250_000), ("site", 12_500_000)]
    assert cfg.bandwidth_caps("b") == {"site": 12_500_000}
    assert parse(_doc()).bandwidth_caps("b") == {}              # no cap: nothing to take from
    assert parse(_doc()).bandwidth_caps("c") == {"peer:c": 1_250_000}


def test_a_bad_cap_in_the_config_names_where_it_is():
    with pytest.raises(ConfigInvalid, match=r"site config: bwlimit = 'lots'"):
        parse(_doc(bwlimit="lots"))
    doc = _doc()
    doc["peers"]["b"]["bwlimit"] = 10
    with pytest.raises(ConfigInvalid, match=r"\[peers.b\]: bwlimit = 10 is 10 bytes/s"):
        parse(doc)


# -- the local bucket and the composite, on a fake clock --------------------------------------------
class Clock:
    """Time that moves only when someone sleeps."""

    def __init__(self):
        self.now = 1000.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s
        self.slept += s


def bucket(clock, rate, burst=None):
    return TokenBucket(rate, burst, clock=clock, sleep=clock.sleep)


def send(limit, total, chunk=64 * KiB):
    for _ in range(total // chunk):
        limit.take(chunk)


def test_a_bucket_lets_its_burst_through_then_holds_the_rate():
    clock = Clock()
    b = bucket(clock, 2 * MiB)                        # burst: a tenth of a second, 204.8 KiB
    assert b.capacity == pytest.approx(0.2 * MiB)
    b.take(128 * KiB)
    assert clock.slept == 0                           # within the burst
    send(b, 20 * MiB)
    # 20 MiB + 128 KiB at 2 MiB/s, less the burst that went at once
    assert clock.slept == pytest.approx((20 * MiB + 128 * KiB - 0.2 * MiB) / (2 * MiB))


def test_a_bucket_refills_while_idle_but_never_past_its_burst():
    clock = Clock()
    b = bucket(clock, MiB, burst=256 * KiB)
    send(b, 2 * MiB)
    clock.now += 60                                   # idle for a minute
    before = clock.slept
    b.take(256 * KiB)
    assert clock.slept == before                      # the burst, at once
    b.take(256 * KiB)
    assert clock.slept - before == pytest.approx(0.25)   # and no more: 256 KiB at 1 MiB/s


def test_a_frame_larger_than_the_burst_waits_for_its_bytes():
    clock = Clock()
    b = bucket(clock, MiB, burst=64 * KiB)
    b.take(MiB)                                       # the bucket goes 960 KiB into debt
    assert clock.slept == pytest.approx(960 / 1024)
    b.take(64 * KiB)
    assert clock.slept == pytest.approx(1.0)


def test_reservations_from_many_threads_add_up():
    """Takers reserve under the bucket's lock: with the clock still, 8 threads x 500 takes
    leave exactly the sum in debt (a lost update would leave less)."""
    clock = Clock()
    b = TokenBucket(MiB, burst=64 * KiB, clock=clock, sleep=lambda s: None)
    threads = [threading.Thread(target=lambda: [b.reserve(1000) for _ in range(500)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.tokens == 64 * KiB - 8 * 500 * 1000
    # the next taker waits for the whole debt: first come, first served
    assert b.reserve(0) == pytest.approx((8 * 500 * 1000 - 64 * KiB) / MiB)


@pytest.mark.parametrize("first, second", [(8, 2), (2, 8), (4, 4)])
def test_the_tighter_limit_wins_in_either_order(first, second):
    clock = Clock()
    limit = AllOf([bucket(clock, first * MiB, burst=64 * KiB), bucket(clock, second * MiB, burst=64 * KiB)])
    send(limit, 40 * MiB)
    tight = min(first, second) * MiB
    # one limit's wait refills the other: the rate is the tighter's, never slower (equal
    # limits do not add up their waits)
    assert clock.slept == pytest.approx((40 * MiB - 64 * KiB) / tight, rel=0.01)


def test_combine_leaves_out_what_is_not_set():
    clock = Clock()
    one = bucket(clock, MiB)
    assert combine() is None and combine(None, None) is None
    assert combine(None, one) is one
    both = combine(one, None, bucket(clock, 2 * MiB))
    assert isinstance(both, AllOf) and len(both.limits) == 2 and both.limits[0] is one


def test_local_caps_are_one_bucket_per_cap_for_the_whole_process():
    caps = {"b": {"peer:b": 2 * MiB, "site": 8 * MiB}, "c": {"site": 8 * MiB}}
    local = LocalBandwidth(lambda peer: caps.get(peer, {"site": 8 * MiB}))
    to_b, to_c = local.limiter("u1", "b"), local.limiter("u2", "c")
    assert [x.rate for x in to_b.limits] == [2 * MiB, 8 * MiB]
    assert to_c is to_b.limits[1]                     # both syncs share the site's bucket
    assert local.limiter("u3", "d") is to_c           # an unknown peer: the site's cap alone
    assert LocalBandwidth(lambda peer: {}).limiter("u", "b") is None
    with local.priority("u1", "b"):                   # kept only by the shared implementation
        pass


def test_grants_are_a_fiftieth_of_a_second_within_bounds():
    assert grant_size(MiB) == GRANT_MIN
    assert grant_size(8 * MiB) == int(8 * MiB / 50)
    assert grant_size(125_000_000) == GRANT_MAX
