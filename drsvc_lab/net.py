"""Free ports, and waits on a condition (never a fixed sleep)."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

from drsvc.errors import Unavailable

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition a lab or a test waited for did not come in time (a test failure)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05) -> T:
    """Call *pred* until it returns something truthy, and return that; after *timeout*
    seconds raise WaitTimeout naming *what* was awaited and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what} (last: {got!r})")
        time.sleep(interval)


def listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout: float = 20, host: str = "127.0.0.1", proc=None) -> None:
    """Until something listens on host:port; fails at once if *proc* (the server) exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"{proc.args[0]} exited with {proc.returncode} before listening on {host}:{port}")
        if listening(port, host):
            return
        time.sleep(0.05)
    raise Unavailable(f"nothing is listening on {host}:{port} after {timeout}s")
