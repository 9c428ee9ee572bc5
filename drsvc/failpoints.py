"""Named failpoints for fault-injection tests: DRSVC_FAILPOINTS="name[,name]" makes the
process SIGKILL itself when it reaches one of them. Off (a dict lookup) otherwise."""
from __future__ import annotations

import os
import signal

_ACTIVE = frozenset(filter(None, os.environ.get("DRSVC_FAILPOINTS", "").split(",")))


def failpoint(name: str) -> None:
    if _ACTIVE and name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
