"""Dispatcher over Celery: queue an operation on its queue (data or control) and wait, bounded."""
from __future__ import annotations

import uuid

import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout

from drsvc.dispatch import raise_from_dict
from drsvc.errors import BrokerUnreachable, OperationInProgress, WorkerFailed

from . import inflight


class CeleryDispatcher:
    def __init__(self, app: Celery):
        self.app = app
        self.cfg = app.drsvc_config
        self.redis = redis.Redis.from_url(self.cfg.redis_url, socket_timeout=10)

    def queue(self, op: str) -> str:
        """The queue *op* goes to: control operations never wait behind syncs."""
        return self.cfg.queue_for(op)

    def submit(self, op: str, unit_id: str, kwargs: dict) -> str:
        task_id = str(uuid.uuid4())
        self.app.send_task(f"drsvc.{op}", args=[unit_id], kwargs=kwargs, task_id=task_id,
                           queue=self.queue(op))
        return task_id

    def run(self, op: str, unit_id: str, kwargs: dict, *, wait: float) -> dict:
        try:
            task_id = str(uuid.uuid4())
            held = inflight.claim(self.redis, self.cfg.site, unit_id, op, kwargs, task_id)
            if held["task_id"] == task_id:
                self.app.send_task(f"drsvc.{op}", args=[unit_id], kwargs=kwargs, task_id=task_id,
                                   queue=self.queue(op), kwargsrepr=None)
            elif held["digest"] != inflight.digest(op, kwargs):
                raise OperationInProgress(f"{held['op']} is in progress for {unit_id}; retry later")
            result = self.app.AsyncResult(held["task_id"])
            try:
                value = result.get(timeout=wait, propagate=False, disable_sync_subtasks=False)
            except CeleryTimeout:
                raise OperationInProgress(f"{op} of {unit_id} is in progress (task {held['task_id']}); "
                                          "retry to follow it") from None
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None
        if isinstance(value, dict):
            return raise_from_dict(value)
        if result.state == "FAILURE":
            # tasks report errors as dicts; an exception here is a worker-side bug: say so
            raise WorkerFailed(op=op, unit_id=unit_id, reason=repr(value))
        raise OperationInProgress(f"{op} of {unit_id} is {result.state}; retry to follow it")
