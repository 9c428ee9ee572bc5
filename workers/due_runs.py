"""Each scheduled unit's next run: a heap by due time in the leader's memory, and a table in
the pool's ``scheduler.sqlite`` that a later leader reads to replay the runs it missed.

A tick pops the runs that are due, so its work follows the due units, not the scheduled
ones. Entries are replaced by pushing anew; a popped entry that is no longer the unit's
current run is dropped (lazy deletion), so a change costs O(log n).
"""
from __future__ import annotations

import heapq
import sqlite3
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Run:
    unit_id: str
    due: float           # when to queue it (a slot, or a replayed slot's new time)
    interval: int
    phase: float


class DueIndex:
    """The next run of every scheduled unit, by due time."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self.runs: dict[str, Run] = {}
        self.pops = 0            # entries popped off the heap, current or stale (work counter)

    def __len__(self) -> int:
        return len(self.runs)

    def put(self, run: Run) -> None:
        self.runs[run.unit_id] = run
        heapq.heappush(self._heap, (run.due, run.unit_id))
        if len(self._heap) > 2 * len(self.runs) + 64:      # stale entries outnumber live ones
            self._heap = [(r.due, r.unit_id) for r in self.runs.values()]
            heapq.heapify(self._heap)

    def remove(self, unit_id: str) -> None:
        self.runs.pop(unit_id, None)

    def next_due(self) -> float | None:
        while self._heap:
            due, unit = self._heap[0]
            r = self.runs.get(unit)
            if r is not None and r.due == due:
                return due
            heapq.heappop(self._heap)
            self.pops += 1
        return None

    def pop_due(self, now: float) -> list[Run]:
        """The runs due at *now*, taken out (the caller puts each unit's next run)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            due, unit = heapq.heappop(self._heap)
            self.pops += 1
            r = self.runs.get(unit)
            if r is not None and r.due == due:
                del self.runs[unit]
                out.append(r)
        return out


class RunTable:
    """The next runs, kept for the next leader: written in one transaction per tick (WAL,
    no fsync per commit: losing the last ones costs a replay, not a schedule)."""

    def __init__(self, path: Path):
        self.db = sqlite3.connect(str(path), timeout=10, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS due_runs (unit_id TEXT PRIMARY KEY, due REAL NOT NULL,"
                        " interval INTEGER NOT NULL)")
        self._adopt_job_store()

    def _adopt_job_store(self) -> None:
        """A pool scheduled by APScheduler's job store keeps its runs: each job's next run
        time is taken over (its interval is checked against the unit's on load)."""
        if not self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='apscheduler_jobs'").fetchone():
            return
        rows = self.db.execute("SELECT id, next_run_time FROM apscheduler_jobs WHERE next_run_time IS NOT NULL")
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR IGNORE INTO due_runs VALUES (?, ?, 0)",
                                [(i.removeprefix("sync:"), t) for i, t in rows if i.startswith("sync:")])
            self.db.execute("DROP TABLE apscheduler_jobs")

    def load(self) -> dict[str, tuple[float, int]]:
        """unit -> (due, interval; 0: not known)."""
        return {u: (d, i) for u, d, i in self.db.execute("SELECT unit_id, due, interval FROM due_runs")}

    def save(self, put: list[Run], removed: list[str]) -> None:
        if not put and not removed:
            return
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO due_runs VALUES (?, ?, ?)",
                                [(r.unit_id, r.due, r.interval) for r in put])
            self.db.executemany("DELETE FROM due_runs WHERE unit_id = ?", [(u,) for u in removed])

    def close(self) -> None:
        self.db.close()
