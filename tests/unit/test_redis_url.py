"""What a redis_url names (drsvc.redis_url): one server or a Sentinel set, the password
merged from DRSVC_REDIS_PASSWORD once, errors that say what is wrong without the password,
and the settings Celery's broker and result backend get for each (workers.redis_client).
The failover itself runs on real redis-server and redis-sentinel processes in
tests/ops/test_sentinel.py."""
from __future__ import annotations

import pytest

from drsvc.config import parse
from drsvc.errors import ConfigInvalid
from drsvc.redis_url import RedisUrlInvalid, check, parse_sentinel, redacted, with_password
from workers.redis_client import celery_settings

pytestmark = pytest.mark.fast


def test_a_sentinel_set_names_its_hosts_service_and_db():
    s = parse_sentinel("sentinel://10.0.0.1:26379,10.0.0.2:26380,[fd00::3]/drsvc-a/2")
    assert s.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("fd00::3", 26379))
    assert (s.service, s.db, s.password) == ("drsvc-a", 2, None)
    assert parse_sentinel("sentinel://h:1/svc").db == 0


@pytest.mark.parametrize("url, says", [
    ("sentinel:///svc", "names no Sentinel"),
    ("sentinel://h:26379", "names no service"),
    ("sentinel://h:26379/svc/x", "/service or /service/db"),
    ("sentinel://h:port/svc", "is not host:port"),
    ("http://h:6379/0", "the scheme must be"),
])
def test_bad_urls_say_why(url, says):
    with pytest.raises(RedisUrlInvalid, match=says):
        check(url)


def test_the_password_is_merged_once_and_never_shown():
    url = with_password("sentinel://h1:1,h2:2/svc", "p@ss/word")
    assert parse_sentinel(url).password == "p@ss/word"
    assert "p@ss" not in redacted(url) and "***" in redacted(url)
    assert with_password("redis://127.0.0.1:6379/0", "pw") == "redis://:pw@127.0.0.1:6379/0"
    with pytest.raises(RedisUrlInvalid, match="carries a password"):
        with_password(url, "again")


def test_the_config_takes_a_sentinel_url_and_the_environments_password(monkeypatch):
    monkeypatch.setenv("DRSVC_REDIS_PASSWORD", "s3cret")
    cfg = parse({"site": "a", "pool": "/p", "redis_url": "sentinel://h1:26379,h2:26379/drsvc-a"})
    assert parse_sentinel(cfg.redis_url).password == "s3cret"
    with pytest.raises(ConfigInvalid, match="names no service"):
        parse({"site": "a", "pool": "/p", "redis_url": "sentinel://h1:26379"})
    with pytest.raises(ConfigInvalid, match="give it once"):
        parse({"site": "a", "pool": "/p", "redis_url": "sentinel://:x@h1:26379/s"})


def test_celery_gets_one_url_per_sentinel_and_the_master_name():
    got = celery_settings("sentinel://:pw@h1:1,h2:2/drsvc-a/3")
    assert got["broker_url"] == got["result_backend"] == "sentinel://:pw@h1:1/3;sentinel://:pw@h2:2/3"
    assert got["transport"]["master_name"] == "drsvc-a"
    plain = celery_settings("redis://127.0.0.1:6379/0")
    assert plain["broker_url"] == "redis://127.0.0.1:6379/0" and plain["transport"] == {}
