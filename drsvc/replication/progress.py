"""Progress of a running sync, kept cheaply for `drsvc status`.

The engine streams records through one ``send`` callable; ``Progress.wrap``
counts the bytes that pass and rewrites a small JSON file (no fsync: it is
ephemeral) at most every ``every`` seconds. ``health.progress_of`` reads it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from . import health


class Progress:
    def __init__(self, path, *, planned: int, generation: int, every: float = 0.5):
        self.path = Path(path)
        self.planned, self.generation, self.every = int(planned), int(generation), every
        self.sent = 0
        self.started_at = time.time()
        self._last = 0.0

    def _write(self) -> None:
        now = time.time()
        self._last = now
        with contextlib.suppress(OSError):
            health._write_json(self.path, {"bytes_sent": self.sent, "bytes_planned": self.planned,
                                           "started_at": self.started_at, "updated_at": now,
                                           "generation": self.generation})

    def wrap(self, send):
        self._write()

        def counted(data):
            send(data)
            self.sent += len(data)
            if time.monotonic() - self._mono > self.every:
                self._mono = time.monotonic()
                self._write()
        self._mono = time.monotonic()
        return counted

    def done(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
