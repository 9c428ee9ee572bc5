"""Redis clients for a site's ``redis_url``: one server, or the master a Sentinel set names
(drsvc.redis_url). Every Redis client drsvc opens is made here, and Celery's broker and
result backend are configured from here, so a Sentinel URL works for all of them.

A client of a Sentinel set asks the Sentinels for the master when it connects and again
whenever a connection to it fails (redis-py's SentinelConnectionPool), so a failover costs
the calls in flight at that moment, not the process: the caller's own retry, or the next
scheduled call, finds the new master.
"""
from __future__ import annotations

import redis
from redis.sentinel import Sentinel

from drsvc import redis_url

# how long a client waits for a Sentinel's answer: a dead one is skipped for the next
SENTINEL_TIMEOUT = 1.0


def connect(url: str, *, socket_timeout: float, socket_connect_timeout: float | None = None,
            retry=None) -> redis.Redis:
    """A client of the server *url* names (of the current master, for a Sentinel set)."""
    kw = {"socket_timeout": socket_timeout}
    if socket_connect_timeout is not None:
        kw["socket_connect_timeout"] = socket_connect_timeout
    if retry is not None:
        kw["retry"] = retry
    if not redis_url.is_sentinel(url):
        return redis.Redis.from_url(url, **kw)
    s = redis_url.parse_sentinel(url)
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs={"socket_timeout": SENTINEL_TIMEOUT,
                                                            "socket_connect_timeout": SENTINEL_TIMEOUT})
    return sentinel.master_for(s.service, db=s.db, password=s.password, **kw)


def celery_settings(url: str) -> dict:
    """Celery settings for a broker and result backend at *url*: the URL as it is for one
    server; for a Sentinel set, kombu's form (one ``sentinel://`` URL per Sentinel, joined by
    ``;``) and the master's name in both transport options (merged into the caller's)."""
    if not redis_url.is_sentinel(url):
        return {"broker_url": url, "result_backend": url, "transport": {}}
    s = redis_url.parse_sentinel(url)
    joined = ";".join(s.each_sentinel())
    options = {"master_name": s.service,
               "sentinel_kwargs": {"socket_timeout": SENTINEL_TIMEOUT, "socket_connect_timeout": SENTINEL_TIMEOUT}}
    return {"broker_url": joined, "result_backend": joined, "transport": options}
