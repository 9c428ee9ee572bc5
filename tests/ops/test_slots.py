"""Per-peer sync slots (workers/slots.py) against a real redis-server: the cap holds, a
running sync keeps its slot past the lease by renewing it, a holder that dies (no
renewal, no release) gives it back one lease later, and one execution's release never
frees another's slot, even under the same task id (a redelivered duplicate)."""
from __future__ import annotations

import time

from drsvc_lab import wait_until
from workers import slots


def test_cap_renewal_lapse_and_own_release(r):
    first = slots.Slot(r, "a", "c", ttl=3, label="task-1")
    twin = slots.Slot(r, "a", "c", ttl=3, label="task-1")        # Redis redelivered task-1
    other = slots.Slot(r, "a", "b", ttl=3, label="task-2")
    assert first.acquire(1)
    lapse = r.zscore(first.key, first.holder)                     # when the first lease ends unrenewed
    assert not twin.acquire(1)                                    # the cap holds, same task id or not
    assert other.acquire(1)                                       # another peer has its own slots
    wait_until(lambda: time.time() > lapse + 1, 10, "the end of the first lease")
    assert slots.holders(r, "a", "c") == [first.holder]           # renewed while it runs
    twin.release()                                                # never held: frees nothing
    assert slots.holders(r, "a", "c") == [first.holder]
    first.release()
    assert slots.holders(r, "a", "c") == []
    assert twin.acquire(1)
    twin.release()

    dead = slots.Slot(r, "a", "c", ttl=3, label="task-3")
    assert dead.acquire(1)
    dead._stop.set()                                              # its worker was killed: no renewal
    dead._renewer.join(5)
    assert not slots.Slot(r, "a", "c", ttl=3).acquire(1)
    late = slots.Slot(r, "a", "c", ttl=3)
    wait_until(lambda: late.acquire(1), 3 + 2, "the dead holder's slot to lapse (one lease later)")
    late.release()
    assert slots.Slot(r, "a", "c", ttl=3).acquire(0)              # no cap: nothing taken
    assert slots.holders(r, "a", "c") == []
    other.release()
