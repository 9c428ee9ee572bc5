"""A process's first operation does not pay for what the process could build as it started.

Measured in the failover bench at 50 ms / 100 Mbit/s (bench/failover.py): on a DR site,
the failover's Promote is the first task its control worker's pool process runs, and the
first call its plugin dispatches. Before, that Promote paid ~0.1 s building the process's
replication jobs (``tasks.jobs_for``, in its first task) and ~0.07 s for the plugin's first
``send_task`` (Celery's result backend, found through the packages' entry points, and the
broker connection): 0.09-0.20 s against 0.03-0.04 s for a Promote in a warm process.

Real parts: a redis-server of the test's own and the Celery app drsvc runs with."""
from __future__ import annotations

import threading

import pytest

from drsvc import config
from workers import tasks
from workers.app import make_app
from workers.client import CeleryDispatcher


def _app(tmp_path, redis_url: str):
    (tmp_path / "pool").mkdir(exist_ok=True)
    return make_app(config.parse({"site": "a", "pool": str(tmp_path / "pool"), "redis_url": redis_url}))


def test_the_jobs_a_pool_process_builds_ahead_are_its_first_tasks(redis_port, tmp_path):
    """``warm_jobs`` (run on a thread by each pool process as it starts) builds the jobs the
    first task then finds, once, however many threads ask at the same time."""
    app = _app(tmp_path, f"redis://127.0.0.1:{redis_port}/0")
    try:
        got = []
        threads = [threading.Thread(target=lambda: (tasks.warm_jobs(app), got.append(tasks.jobs_for(app))))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 4 and all(j is got[0] for j in got), "the jobs were built more than once"
        assert tasks.jobs_for(app) is got[0]          # what the first task uses
        assert got[0].dispatcher.redis.ping()
    finally:
        tasks._services.pop(id(app), None)


def test_warming_a_dispatcher_without_redis_leaves_the_error_to_the_first_call(tmp_path):
    """Redis down as the process starts: ``warm`` gives up quietly, and the first call
    reports the broker as unreachable, as it would have."""
    import socket

    from drsvc.errors import BrokerUnreachable
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                         # nothing listens there
    d = CeleryDispatcher(_app(tmp_path, f"redis://127.0.0.1:{port}/0"))
    d.warm()
    with pytest.raises(BrokerUnreachable):
        d.run("promote", "vol-1", {"force": False}, wait=2)
