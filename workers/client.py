"""Dispatcher over Celery: queue an operation on its queue (data or control) and wait, bounded."""
from __future__ import annotations

import logging
import threading
import time
import uuid

import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.exceptions import OperationalError as KombuOperationalError

from drsvc.dispatch import raise_from_dict
from drsvc.errors import (BrokerUnreachable, DrsvcError, NodeUnreachable, NotGroupConsistent, OperationInProgress,
                          WorkerFailed)

from . import inflight, presence
from .bandwidth import RedisBandwidth, client
from .redis_client import connect

log = logging.getLogger(__name__)

LOOK_EVERY = 2.0     # seconds between looks for a followed task's message
RESEND_LOST = 2      # a lost task is sent again at most this many times within one call


def load_result_backend(app: Celery) -> None:
    """Load Celery's result backend in this thread now. The plugin runs it in each gRPC
    handler thread as it starts them, before it serves (csi_plugin.server.handler_pool):
    Celery keeps one backend object per thread, and the first thread's call also imports
    it and scans the installed packages' entry points for it, all of which a call would otherwise pay on its way; a DR site's plugin
    may dispatch nothing before its failover's Promote. It opens no connection."""
    _ = app.backend


class CeleryDispatcher:
    def __init__(self, app: Celery):
        self.app = app
        self.cfg = app.drsvc_config
        self.redis = connect(self.cfg.redis_url, socket_timeout=10)
        self._bandwidth: RedisBandwidth | None = None
        self._bandwidth_lock = threading.Lock()

    def queue(self, op: str) -> str:
        """The queue *op* goes to: control operations never wait behind syncs."""
        return self.cfg.queue_for(op)

    def submit(self, op: str, unit_id: str, kwargs: dict) -> str:
        task_id = str(uuid.uuid4())
        self.app.send_task(f"drsvc.{op}", args=[unit_id], kwargs=kwargs, task_id=task_id,
                           queue=self.queue(op))
        return task_id

    def cut(self, group_id: str, nodes, *, demote: bool = False) -> RedisCut:
        """How this node's part of *group_id* (members on *nodes*) meets the others; demote:
        for a Demote's final round, which meets only the others' final rounds."""
        return RedisCut(self.redis, self.cfg.site, group_id, self.cfg.node_id, nodes, demote=demote)

    def bandwidth(self) -> RedisBandwidth:
        """The site's bandwidth caps (drsvc.transport.bandwidth.SiteBandwidth), one per process.
        Its own Redis client answers within 1 s or not at all (``bandwidth.client``): a sync
        must not stall on a hung Redis (it goes on at its process's share). Every process of both workers (data and
        control), on every node, may sync at once: that many shares."""
        with self._bandwidth_lock:
            if self._bandwidth is None:
                r = client(self.cfg.redis_url)
                shares = 2 * (self.app.conf.worker_concurrency or 2) * max(1, len(self.cfg.nodes))
                self._bandwidth = RedisBandwidth(r, self.cfg.site, self.cfg.cap_schedules, shares=shares)
            return self._bandwidth

    def run(self, op: str, unit_id: str, kwargs: dict, *, wait: float) -> dict:
        """Run *op* on the unit, or join the same operation in flight, and answer within *wait*
        (else OperationInProgress: the CO's retry follows the same task). A task whose message
        was lost (``presence``) gives up its claim and is sent again, within the same wait."""
        deadline = time.monotonic() + wait
        try:
            for _ in range(1 + RESEND_LOST):
                try:
                    return self._run_once(op, unit_id, kwargs, deadline)
                except _Lost as lost:
                    log.warning("%s of %s: task %s is queued nowhere, taken by no worker and "
                                "unanswered (its message was lost with a Redis restart, or never sent by "
                                "a caller that died); sending it again", op, unit_id, lost.task_id)
                    inflight.release(self.redis, self.cfg.scope, unit_id, lost.task_id)
            raise OperationInProgress(f"{op} of {unit_id}: its task was lost {1 + RESEND_LOST} times; retry")
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None

    def _run_once(self, op: str, unit_id: str, kwargs: dict, deadline: float) -> dict:
        task_id = str(uuid.uuid4())
        held = inflight.claim(self.redis, self.cfg.scope, unit_id, op, kwargs, task_id)
        if held["task_id"] == task_id:
            self.app.send_task(f"drsvc.{op}", args=[unit_id], kwargs=kwargs, task_id=task_id,
                               queue=self.queue(op), kwargsrepr=None)
            inflight.confirm(self.redis, self.cfg.scope, unit_id, task_id)
        elif held["digest"] != inflight.digest(op, kwargs):
            raise OperationInProgress(f"{held['op']} is in progress for {unit_id}; retry later")
        result = self.app.AsyncResult(held["task_id"])
        value = self._follow(op, unit_id, result, deadline)
        if isinstance(value, dict):
            return raise_from_dict(value)
        if result.state == "FAILURE":
            # Tasks report their errors as dicts, so a FAILURE is either a task whose answer
            # could not be stored (Redis went away as it finished: Celery then records the
            # connection error) or a worker-side bug. Either way the claim may have outlived
            # the task (its release needed Redis too): drop it, so a retry runs anew (every
            # operation is repeat-safe) instead of following this answer for hours.
            inflight.release(self.redis, self.cfg.scope, unit_id, held["task_id"])
            if isinstance(value, (redis.RedisError, ConnectionError, KombuOperationalError)):
                raise BrokerUnreachable(reason=f"the answer of {op} of {unit_id} was lost with the "
                                               f"connection ({type(value).__name__}); retry")
            raise WorkerFailed(op=op, unit_id=unit_id, reason=repr(value))
        raise OperationInProgress(f"{op} of {unit_id} is {result.state}; retry to follow it")

    def _follow(self, op: str, unit_id: str, result, deadline: float):
        """The task's answer, waited for until *deadline*, looking every LOOK_EVERY seconds
        whether its message still exists. Absent at two looks in a row: lost (_Lost)."""
        absent_before = False
        while True:
            left = deadline - time.monotonic()
            try:
                return result.get(timeout=max(0.01, min(LOOK_EVERY, left)), propagate=False,
                                  disable_sync_subtasks=False)
            except CeleryTimeout:
                if left <= LOOK_EVERY:
                    raise OperationInProgress(f"{op} of {unit_id} is in progress (task {result.id}); "
                                              "retry to follow it") from None
            absent = presence.where(self.redis, self.app, self.queue(op), result.id) == presence.ABSENT
            if absent and absent_before:
                raise _Lost(result.id)
            absent_before = absent


class _Lost(Exception):
    def __init__(self, task_id: str):
        super().__init__(task_id)
        self.task_id = task_id


# node calls dropped from a node's queue once their caller gave up: those that only read,
# a group snapshot's part (its barrier is long gone by then), and Replication calls. A
# Promote the controller answered UNAVAILABLE for, run when the node's api worker comes
# back, would change a role behind the operator's back (a second primary, when the
# operator has kept or put the old site back meanwhile); the CO's retry asks again.
EXPIRING_NODE_OPS = frozenset({"probe", "capacity", "get_volume", "list_volumes", "validate",
                               "get_snapshot", "list_snapshots", "get_group", "list_groups",
                               "get_group_snapshot", "group_snapshot_part", "replication"})


class NodeDispatcher:
    """drsvc.cluster.NodeCalls over Celery: a site controller's calls on its storage nodes,
    each a drsvc.node task on the node's queue; client-chosen names claimed in Redis."""

    def __init__(self, app: Celery):
        self.app = app
        self.cfg = app.drsvc_config
        self.redis = connect(self.cfg.redis_url, socket_timeout=10)

    def _send(self, node: str, op: str, kwargs: dict, wait: float):
        return self.app.send_task("drsvc.node", args=[op, kwargs], queue=self.cfg.api_queue(node),
                                  expires=wait if op in EXPIRING_NODE_OPS else None)

    def _result(self, node: str, op: str, result, wait: float):
        try:
            value = result.get(timeout=max(0.01, wait), propagate=False, disable_sync_subtasks=False)
        except CeleryTimeout:
            raise NodeUnreachable(node=node, site=self.cfg.site, wait=wait,
                                  reason=f"{op} is queued or running there (task {result.id})") from None
        result.forget()               # answered: nothing to keep in Redis
        if isinstance(value, dict):
            return raise_from_dict(value).get("value")
        raise WorkerFailed(op=op, unit_id=node, reason=repr(value))

    def call(self, node: str, op: str, kwargs: dict, *, wait: float):
        try:
            return self._result(node, op, self._send(node, op, kwargs, wait), wait)
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None

    def call_each(self, calls: dict[str, dict], op: str, *, wait: float) -> dict:
        try:
            sent = {n: self._send(n, op, kwargs, wait) for n, kwargs in calls.items()}
            deadline = time.monotonic() + wait
            out = {}
            for n, res in sent.items():
                try:
                    out[n] = self._result(n, op, res, deadline - time.monotonic())
                except DrsvcError as e:
                    out[n] = e
            return out
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None

    # -- names: claimed for a node (SET NX), and remembered per object id -----------------
    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"

    def _key(self, key: str) -> str:
        return f"drsvc:{self.cfg.site}:names:{key}"

    def _id_key(self, object_id: str) -> str:
        return f"drsvc:{self.cfg.site}:name-of:{object_id}"

    def _redis(self, fn, *args, **kwargs):
        """One Redis command; a lost Redis is the site's BrokerUnreachable (UNAVAILABLE)."""
        try:
            v = fn(*args, **kwargs)
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None
        return v.decode() if isinstance(v, bytes) else v

    def holder(self, key: str) -> str | None:
        return self._redis(self.redis.get, self._key(key))

    def claim(self, key: str, node: str) -> str:
        self._redis(self.redis.set, self._key(key), node, nx=True)
        return self._redis(self.redis.get, self._key(key))

    def release(self, key: str, node: str) -> None:
        try:
            self._redis(self.redis.eval, self._RELEASE, 1, self._key(key), node)
        except BrokerUnreachable:
            pass                       # a stale claim only sends a retry to the same node

    def bind(self, object_id: str, key: str) -> None:
        self._redis(self.redis.set, self._id_key(object_id), key)

    def unbind(self, object_id: str) -> str | None:
        return self._redis(self.redis.getdel, self._id_key(object_id))


class RedisBarrier:
    """drsvc.cluster.Barrier in the site's Redis: the parts of a group snapshot cut on
    several nodes meet here, frozen, before any of them clones."""

    def __init__(self, r: redis.Redis, key: str, parties: int, timeout: float):
        self.r, self.key, self.parties, self.timeout = r, key, parties, timeout

    def wait(self) -> None:
        try:
            self.r.incr(self.key)
            self.r.expire(self.key, 600)
            deadline = time.monotonic() + self.timeout
            while int(self.r.get(self.key) or 0) < self.parties:
                if time.monotonic() > deadline:
                    raise NotGroupConsistent(reason=f"not every node froze its members within {self.timeout:.0f}s; "
                                                    "nothing was cut")
                time.sleep(0.002)
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None


# One Lua call joins a part to the open round of a cut (or opens one) and, when it is the
# last part to arrive, marks the round passed and closes it, so the next sync of the same
# generation (after a failed round) opens a new one. A round marked failed stays failed.
_JOIN = """
local rid = redis.call('GET', KEYS[1])
if not rid then
  rid = ARGV[1]
  redis.call('SET', KEYS[1], rid, 'EX', 120)
end
local m = ARGV[4] .. rid
redis.call('SADD', m .. ':frozen', ARGV[2])
redis.call('EXPIRE', m .. ':frozen', 600)
if redis.call('SCARD', m .. ':frozen') >= tonumber(ARGV[3]) then
  redis.call('SET', m .. ':cut', 'passed', 'NX', 'EX', 600)
  if redis.call('GET', KEYS[1]) == rid then redis.call('DEL', KEYS[1]) end
end
return rid
"""
# A part that waited too long fails the round unless it passed meanwhile.
_GIVE_UP = """
redis.call('SET', KEYS[2], 'failed', 'NX', 'EX', 600)
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return redis.call('GET', KEYS[2])
"""
_VOTE = """
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], 'commit', 'NX', 'EX', tonumber(ARGV[3]))
end
return redis.call('GET', KEYS[2])
"""


class RedisCut:
    """drsvc.replication.sender.group_rounds.Cut in the site's Redis, for one node's part of a group.

    Keys (``drsvc:<site>:cut:``…): ``open:<group>:<epoch>:<gen>`` points at the round
    being cut (``…:demote`` for a Demote's final round); ``round:<id>:frozen`` / ``:cut``
    (passed|failed) the meeting; ``round:<id>:prepared`` the votes and
    ``round:<id>:decision`` (commit|abort), set once and kept a week, so a part that
    crashed settles the round at its next sync.

    demote: this part's round is a Demote's final round. It meets only the other parts'
    final rounds: met by another part's scheduled round, the round would carry the
    demotion mark to one peer node alone, and the other part's final round would find no
    one left to meet. While it waits it raises ``demoting:<group>:<epoch>``, and a
    scheduled round waiting at the same cut gives way at once (its part's final round
    is queued behind it)."""

    FREEZE_WAIT = 5.0           # the longest a part holds its freeze waiting for the others
    VOTE_WAIT = 300.0           # the longest a prepared part waits for the slowest stream
    KEEP = 7 * 86400

    def __init__(self, r: redis.Redis, site: str, group_id: str, node: str, nodes, *,
                 freeze_wait: float | None = None, vote_wait: float | None = None, demote: bool = False):
        self.r, self.group_id, self.node, self.demote = r, group_id, node, demote
        self.parts = len(set(nodes))
        self.prefix = f"drsvc:{site}:cut:"
        self.freeze_wait = self.FREEZE_WAIT if freeze_wait is None else freeze_wait
        self.vote_wait = self.VOTE_WAIT if vote_wait is None else vote_wait

    def _round(self, rid: str) -> str:
        return f"{self.prefix}round:{rid}"

    def _redis(self, fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except redis.RedisError as e:
            raise BrokerUnreachable(reason=type(e).__name__) from None

    def frozen(self, epoch: int, generation: int) -> str:
        opening = f"{self.prefix}open:{self.group_id}:{epoch}:{generation}" + (":demote" if self.demote else "")
        demoting = f"{self.prefix}demoting:{self.group_id}:{epoch}"
        if self.demote:
            self._redis(self.r.set, demoting, self.node, ex=max(1, int(self.freeze_wait) + 1))
        rid = self._redis(self.r.eval, _JOIN, 1, opening, uuid.uuid4().hex, self.node, self.parts,
                          f"{self.prefix}round:")
        rid = rid.decode() if isinstance(rid, bytes) else rid
        state_key = f"{self._round(rid)}:cut"
        deadline = time.monotonic() + self.freeze_wait
        reason = f"not every node of group {self.group_id} froze its members within {self.freeze_wait:.0f}s"
        while True:
            state, demoted_by = self._redis(self.r.mget, state_key, demoting)
            give_way = demoted_by is not None and not self.demote
            if state is None and (give_way or time.monotonic() > deadline):
                if give_way:
                    reason = f"a Demote of group {self.group_id} is cutting its final round on {demoted_by.decode()}"
                state = self._redis(self.r.eval, _GIVE_UP, 2, opening, state_key, rid)
            if state == b"passed":
                return rid
            if state == b"failed":
                raise NotGroupConsistent(reason=f"{reason}; nothing was cut")
            time.sleep(0.002)

    def vote(self, round_id: str) -> bool:
        votes, decision = f"{self._round(round_id)}:prepared", f"{self._round(round_id)}:decision"
        out = self._redis(self.r.eval, _VOTE, 2, votes, decision, self.node, self.parts, self.KEEP)
        deadline = time.monotonic() + self.vote_wait
        while out is None:
            if time.monotonic() > deadline:
                return self.decision(round_id)
            time.sleep(0.01)
            out = self._redis(self.r.get, decision)
        return out == b"commit"

    def fail(self, round_id: str | None) -> None:
        if round_id:
            self._redis(self.r.set, f"{self._round(round_id)}:decision", "abort", nx=True, ex=self.KEEP)

    def decision(self, round_id: str) -> bool:
        key = f"{self._round(round_id)}:decision"
        self._redis(self.r.set, key, "abort", nx=True, ex=self.KEEP)     # presumed abort
        return self._redis(self.r.get, key) == b"commit"
