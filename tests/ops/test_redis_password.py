"""The Redis password is given once, in the environment (DRSVC_REDIS_PASSWORD), never in
site.toml (written once, not in the Secret and in redis_url both)."""
from __future__ import annotations

import pytest
import redis

from drsvc.config import load
from drsvc.errors import ConfigInvalid
from drsvc_lab import free_port, spawn_redis

PASSWORD = "p@ss:w/rd #1"        # characters a URL must quote


@pytest.fixture
def guarded_redis(tmp_path):
    port = free_port()
    proc = spawn_redis(tmp_path / "redis", port, PASSWORD, persist=False)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait()


def site_toml(tmp_path, url: str):
    p = tmp_path / "site.toml"
    p.write_text(f'site = "a"\npool = "{tmp_path}/pool"\nredis_url = "{url}"\n')
    return p


def test_the_password_comes_from_the_environment(guarded_redis, tmp_path, monkeypatch):
    path = site_toml(tmp_path, f"redis://127.0.0.1:{guarded_redis}/0")
    monkeypatch.delenv("DRSVC_REDIS_PASSWORD", raising=False)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(load(path).redis_url).ping()
    monkeypatch.setenv("DRSVC_REDIS_PASSWORD", PASSWORD)
    cfg = load(path)
    assert redis.Redis.from_url(cfg.redis_url).ping()
    # the Celery app (broker and results) uses the same URL
    from workers.app import make_app
    with make_app(cfg).connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
    assert PASSWORD not in repr(cfg.redis_url.split("@")[1])


def test_a_password_given_twice_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DRSVC_REDIS_PASSWORD", "one")
    with pytest.raises(ConfigInvalid, match="give it once"):
        load(site_toml(tmp_path, "redis://:two@127.0.0.1:6379/0"))
    monkeypatch.delenv("DRSVC_REDIS_PASSWORD")
    assert load(site_toml(tmp_path, "redis://:two@127.0.0.1:6379/0")).redis_url == "redis://:two@127.0.0.1:6379/0"
    monkeypatch.setenv("DRSVC_REDIS_PASSWORD", "x")
    assert load(site_toml(tmp_path, "redis://user@[::1]:6380/2")).redis_url == "redis://user:x@[::1]:6380/2"
