"""Fixtures shared by the ops tests."""
from __future__ import annotations

import pytest
import redis

from drsvc import runner
from drsvc_lab import free_port, wait_port


@pytest.fixture
def redis_port(tmp_path):
    """A redis-server of the test's own on a free port (no persistence); yields its port."""
    port = free_port()
    with open(tmp_path / "redis.log", "wb") as log:
        proc = runner.spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=log, stderr=log)
    try:
        wait_port(port)
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def r(redis_port):
    return redis.Redis(port=redis_port)
