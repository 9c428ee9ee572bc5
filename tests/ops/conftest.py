"""Fixtures shared by the ops tests."""
from __future__ import annotations

import pytest
import redis

from drsvc_lab import free_port, spawn_redis


@pytest.fixture
def redis_port(tmp_path):
    """A redis-server of the test's own on a free port (no persistence); yields its port."""
    port = free_port()
    proc = spawn_redis(tmp_path / "redis", port, persist=False)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def r(redis_port):
    return redis.Redis(port=redis_port)
