"""Peak resident set sizes (VmHWM) of processes chosen by command line, sampled from /proc."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable


def vm_hwm(pid: int) -> int:
    """Peak RSS of *pid* in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cmdline(pid: int | str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def receiver_of(pool) -> Callable[[bytes], bool]:
    """Matches a drsvc receiver serving *pool* (other people's receivers are left out)."""
    want = str(pool).encode()
    return lambda cmd: b"drsvc.replication.receiver" in cmd and want in cmd


class PeakRss:
    """Samples, every few ms while open, the peak RSS of every process whose command line
    *match* accepts, plus the pids given to watch(); keeps the maximum seen."""

    def __init__(self, match: Callable[[bytes], bool] | None = None, interval: float = 0.005):
        self.match = match
        self.interval = interval
        self.peak = 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        self.pids.add(pid)

    def sample(self) -> None:
        pids = set(self.pids)
        if self.match is not None:
            for p in os.listdir("/proc"):
                if p.isdigit() and self.match(cmdline(p)):
                    pids.add(int(p))
        for pid in pids:
            self.peak = max(self.peak, vm_hwm(pid))

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()
