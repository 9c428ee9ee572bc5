"""Waiting in a long-running process's main thread for the signal that stops it.

A process-directed SIGTERM goes to any thread that does not block it, gRPC's and the
Redis clients' threads included. Python runs the handler in the main thread, but an
untimed ``Event.wait()`` there is woken only by a signal delivered to the main thread
itself: one taken by another thread sets the flag and nothing reads it. The node plugin
slept through its SIGTERM that way (the multinode tests under load, and a pod would wait
out its grace period for the SIGKILL). A timed wait lets the main thread look again.
"""
from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Handlers for *signals*, installed at once; ``wait`` returns the first that arrives
    (within *poll* seconds of its delivery, whichever thread the kernel gave it to)."""

    def __init__(self, signals=STOP_SIGNALS):
        self._stop = threading.Event()
        self._got: list[int] = []
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum, _frame) -> None:
        self._got.append(signum)
        self._stop.set()

    def wait(self, poll: float = 0.5) -> int:
        while not self._stop.wait(poll):
            pass
        return self._got[0]


def wait_for_stop(signals=STOP_SIGNALS) -> int:
    return StopSignals(signals).wait()
