"""The Celery app factory: one app per site, bound to that site's Redis and queue."""
from __future__ import annotations

import logging

from celery import Celery
from celery.app.amqp import AMQP

from drsvc.config import SiteConfig

from . import tasks
from .redis_client import celery_settings

log = logging.getLogger(__name__)


def _survive_broker_loss() -> None:
    """kombu 5.7's Redis transport, after a lost connection, still acks and restores the
    messages of the channel it dropped, through the connection it already let go
    (AttributeError): the worker died on every Redis restart. Those messages stay in
    Redis's unacked set, so skipping them is safe: the visibility sweep redelivers them,
    and every drsvc task is idempotent."""
    from kombu.transport import redis as kombu_redis
    qos = kombu_redis.QoS
    if getattr(qos, "_drsvc_survives_broker_loss", False):
        return

    def dropped(self) -> bool:
        conn = getattr(self.channel, "connection", None)
        return conn is None or conn.client is None

    def guard(method):
        def guarded(self, *args, **kwargs):
            if dropped(self):
                log.warning("broker connection gone: %s skipped; the visibility sweep redelivers",
                            method.__name__)
                return None
            return method(self, *args, **kwargs)
        return guarded

    for name in ("ack", "reject", "restore_unacked"):
        setattr(qos, name, guard(getattr(qos, name)))
    qos._drsvc_survives_broker_loss = True


def label_task(headers: dict) -> None:
    """Name each drsvc task for its unit ("drsvc.sync vol-…"): Celery's *shadow* name, which
    the worker's logs, its events and so Flower's task list show; the task stays routed by
    its real name. Tasks carry the unit id as their first argument."""
    name = headers.get("task") or ""
    argsrepr = headers.get("argsrepr") or ""
    if not name.startswith("drsvc.") or headers.get("shadow"):
        return
    unit = argsrepr.strip("[]()").split(",")[0].strip().strip("'\"")
    if unit:
        headers["shadow"] = f"{name} {unit}"


TIME_KWARGS = ("scheduled_at",)


def readable_kwargs(kwargs: dict | None) -> str | None:
    """The kwargs as Flower shows them: a scheduled sync's slot in UTC, not epoch seconds
    ({'trigger': 'schedule', 'scheduled_at': '2026-11-25 16:20:00 UTC'}). None: nothing to change."""
    if not kwargs or not any(isinstance(kwargs.get(k), (int, float)) for k in TIME_KWARGS):
        return None
    import datetime as dt
    shown = {k: dt.datetime.fromtimestamp(v, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
             if k in TIME_KWARGS and isinstance(v, (int, float)) else v for k, v in kwargs.items()}
    return repr(shown)


class LabelledAMQP(AMQP):
    """Messages named for their unit: the shadow header (worker events) and the task-sent
    event alike, so Flower's row keeps the name whichever event it sees last; and kwargs shown
    with readable times (the task itself still gets the numbers)."""

    def as_task_v2(self, task_id, name, args=None, kwargs=None, *rest, **options):
        msg = super().as_task_v2(task_id, name, args, kwargs, *rest, **options)
        label_task(msg.headers)
        if (shown := readable_kwargs(kwargs)) is not None:
            msg.headers["kwargsrepr"] = shown
            if msg.sent_event is not None:
                msg.sent_event["kwargs"] = shown
        if msg.sent_event is not None and msg.headers.get("shadow"):
            msg.sent_event["name"] = msg.headers["shadow"]
        return msg


def make_app(cfg: SiteConfig) -> Celery:
    _survive_broker_loss()
    redis = celery_settings(cfg.redis_url)
    app = Celery(f"drsvc-{cfg.site}", broker=redis["broker_url"], backend=redis["result_backend"], amqp=LabelledAMQP)
    app.conf.update(
        task_default_queue=cfg.queue,
        task_acks_late=True,                # a worker killed mid-sync gets the task redelivered
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        task_send_sent_event=True,          # Flower shows queued tasks too
        worker_send_task_events=True,
        result_extended=True,               # task name and args in the result backend
        result_expires=7 * 24 * 3600,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        # kombu sweeps for abandoned tasks every interval x throttle seconds (10 x 10 by
        # default): a SIGKILLed worker's task came back ~100 s late whatever the timeout.
        # One sweeper at a time, under a mutex key that outlives a Redis restart (AOF): one
        # held as Redis went away would stop every sweep for its default 300 s. A sweep takes
        # milliseconds, and restoring a message is a transaction of its own.
        broker_transport_options={"visibility_timeout": cfg.visibility_timeout,
                                  "unacked_restore_interval": max(1, min(10, cfg.visibility_timeout // 4)),
                                  "unacked_restore_throttle": 1,
                                  "unacked_mutex_expire": max(5, min(30, cfg.visibility_timeout // 2)),
                                  **redis["transport"]},
        result_backend_transport_options=redis["transport"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    app.drsvc_config = cfg
    tasks.register(app)
    return app
