"""Progress of a running sync, kept cheaply for `drsvc status`.

The engine streams records through one ``send`` callable; ``Progress.wrap``
counts the bytes that pass and rewrites a small JSON file (no fsync: it is
ephemeral) at most every ``every`` seconds. ``progress_of`` reads it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ... import store
from ...layout import PoolLayout

PROGRESS = "progress.json"        # beside the unit's state while a sync streams


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
            store.write_ephemeral_json(self.path, {"bytes_sent": self.sent, "bytes_planned": self.planned,
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


def progress_path(pool, unit_id: str) -> Path:
    return PoolLayout(pool).unit_dir(unit_id) / PROGRESS


def progress_of(pool, unit_id: str, *, now: float | None = None, stale_s: float = 30.0,
                path: str | None = None) -> dict | None:
    """A running sync's progress: bytes sent, bytes planned, rate. None when none runs.
    *path*: the unit's progress_path, when the caller keeps it (a listing of many units)."""
    doc = store.read_json(path or progress_path(pool, unit_id))
    now = time.time() if now is None else now
    if not doc or now - float(doc.get("updated_at") or 0) > stale_s:
        return None
    elapsed = max(1e-6, float(doc["updated_at"]) - float(doc["started_at"]))
    return {"bytes_sent": int(doc["bytes_sent"]), "bytes_planned": int(doc["bytes_planned"]),
            "started_at": float(doc["started_at"]), "rate_bps": int(doc["bytes_sent"]) / elapsed,
            "generation": int(doc.get("generation") or 0)}
