"""Where a task's message is in the site's Redis: queued, taken by a worker, answered, or
nowhere at all.

kombu's Redis transport takes a message off its queue (BRPOP) and only then records it as
taken but not acknowledged (a second command, into the ``unacked`` hash that its visibility
sweep redelivers from). Redis going away between the two loses the message: no worker ever
runs it. A caller that claimed the unit for that task (``inflight``) would then follow it
for the claim's whole life, and every retry of a failover would answer "in progress".
A lost message is told from one in transit by looking twice, apart (``CeleryDispatcher``).

Every look is one Lua script, so Redis moves nothing between its parts: a message is
found in a queue, in the unacked hash, or by its stored answer (a task's answer is stored
before its message is acknowledged).
"""
from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery, states
from kombu.transport import redis as kombu_redis

QUEUED, TAKEN, ANSWERED, ABSENT = "queued", "taken", "answered", "absent"

_WHERE = """
local id = ARGV[1]
local meta = redis.call('get', KEYS[1])
if meta then
  local ok, m = pcall(cjson.decode, meta)
  if ok and type(m) == 'table' and string.find(ARGV[2], '|' .. tostring(m['status']) .. '|', 1, true) then
    return 'answered'
  end
end
for i = 2, #KEYS - 1 do
  for _, v in ipairs(redis.call('lrange', KEYS[i], 0, -1)) do
    if string.find(v, id, 1, true) then return 'queued' end
  end
end
for _, v in ipairs(redis.call('hvals', KEYS[#KEYS])) do
  if string.find(v, id, 1, true) then return 'taken' end
end
return 'absent'
"""
_READY = "|" + "|".join(sorted(states.READY_STATES)) + "|"


@dataclass(frozen=True)
class MessageKeys:
    """The Redis keys kombu keeps a queue's messages under (one list per priority step) and
    its unacked hash, as the app's transport options name them."""
    queues: tuple[str, ...]
    unacked: str

    @classmethod
    def of(cls, app: Celery, queue: str) -> MessageKeys:
        opts = app.conf.broker_transport_options or {}
        ch = kombu_redis.Channel
        prefix = opts.get("global_keyprefix", ch.global_keyprefix)
        sep = opts.get("sep", ch.sep)
        steps = opts.get("priority_steps", ch.priority_steps)
        names = [queue] + [f"{queue}{sep}{p}" for p in steps if p]
        return cls(tuple(prefix + n for n in names), prefix + opts.get("unacked_key", ch.unacked_key))


def where(r: redis.Redis, app: Celery, queue: str, task_id: str) -> str:
    """QUEUED, TAKEN (by a worker, running or about to), ANSWERED, or ABSENT."""
    keys = MessageKeys.of(app, queue)
    meta_key = app.backend.get_key_for_task(task_id)
    out = r.eval(_WHERE, 2 + len(keys.queues), meta_key, *keys.queues, keys.unacked, task_id, _READY)
    return out.decode() if isinstance(out, bytes) else out
