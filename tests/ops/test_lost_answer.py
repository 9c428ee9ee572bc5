"""A control task whose answer was lost with Redis (tests/faults/test_restarts.py
::test_redis_restarted_during_promote found it): the task finished while Redis was away,
so its in-flight claim could not be released, and Celery, failing to store the answer,
recorded the connection error as the task's FAILURE once Redis came back. A retried
PromoteVolume then followed that stale claim and answered INTERNAL ("failed in the worker")
for as long as the claim lived. Now the caller drops the claim and answers UNAVAILABLE, and
the next retry runs the (repeat-safe) operation again.

Real parts: a redis-server of the test's own, the Celery app and result backend drsvc runs
with (workers.app.make_app); the lost answer is what that backend stores."""
from __future__ import annotations

import pytest
import redis

from drsvc import config
from drsvc.errors import BrokerUnreachable, WorkerFailed
from workers import inflight
from workers.app import make_app
from workers.client import CeleryDispatcher


@pytest.fixture
def dispatcher(redis_port, tmp_path):
    cfg = config.parse({"site": "a", "pool": str(tmp_path / "pool"), "redis_url": f"redis://127.0.0.1:{redis_port}/0"})
    return CeleryDispatcher(make_app(cfg))


@pytest.mark.parametrize("lost, answer", [(redis.ConnectionError("Connection refused"), BrokerUnreachable),
                                          (KeyError("a worker-side bug"), WorkerFailed)])
def test_a_failed_task_does_not_keep_its_claim(dispatcher, r, lost, answer):
    kwargs = {"force": False}
    held = inflight.claim(r, "a", "vol-1", "promote", kwargs, "task-lost")
    assert held["task_id"] == "task-lost"
    dispatcher.app.backend.mark_as_failure("task-lost", lost)
    with pytest.raises(answer):
        dispatcher.run("promote", "vol-1", kwargs, wait=5)
    assert inflight.holder(r, "a", "vol-1") is None          # the retry will run anew
