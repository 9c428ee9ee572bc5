"""Verify (scrub) of a secondary's replica: is the DR copy really there?

Run at the secondary (``jobs.run_verify``: on the scheduler's verify interval, or `drsvc
verify`). It reads every member's replica image from disk, recomputes the block digests
exactly as the sender's scan does, and compares them

- with the block map the receiver recorded as it applied the transactions
  (``common.replica_maps``, when its record names the unit's generation), and
- with the primary's acked snapshot of the same generation (the ``snaphashes UNIT
  GENERATION`` verb, as ``consistency.compare_with_primary`` reads it; checked when the
  primary answers, skipped with a note when it does not).

It works in windows (``WINDOW_BYTES``): the unit's lock is taken for one window's read and
let go before the next, so a sync waits at most one window. A sync that lands meanwhile
moves the unit to a newer generation: the receiver's map then says which blocks it
rewrote (their digests differ from the copy of the map taken at the start), and those
blocks are checked against the new map only, not against the primary's older snapshot.
Without a recorded map a moved generation ends the verify as incomplete. Then the kept
recovery points are checked against the digests recorded as their bytes were written
(``scrub_points``). Reads go
through a rate cap (``ReadPacer``, the site's ``verify_read_rate``), waited out with the
lock let go.

The outcome is ``verify.json`` (``VerifyRecord``): the last run, the last failure (kept
until a complete clean run or a repair), and a repair asked for. A repair names the
differing block runs to the primary (``unit_state.request_repair``): its next delta re-sends
them beside what changed, in one ordinary transaction. Too many runs to name
(``scrub_plan.REPAIR_RUNS``): a compare sync (``unit_state.request_resync``), which diffs
the primary's capture against every block of this replica.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from ...errors import DrsvcError, NotSecondary, OperationInProgress, ReplicationConflict
from ...layout import PoolLayout
from ..common.blockmap import BlockMap, copy_map, hash_range
from ..common.replica_maps import ReplicaMaps
from ..common.unit_state import get_state
from ..receiver.replica import UnitLock, recover
from ..sender.receiver_client import read_maps, reader_for
from ..common.read_pacer import ReadPacer
from .scrub_plan import NAMED, WINDOW_BYTES, Findings, compare_window, plan_windows
from .scrub_points import PointsCheck

log = logging.getLogger(__name__)

LOCK_PATIENCE = 600.0        # seconds a window waits for a long sync to let the unit go
PRIMARY_PATIENCE = 60.0      # seconds the primary's answer is waited for past its syncs in flight
READ_BUF = 1 << 20


class Stopped(Exception):
    """The verify cannot go on (the unit changed under it); what it checked stays reported."""


class Scrub:
    """One verify of a secondary's replica. *open_peer* () -> transport.Peer of the primary."""

    def __init__(self, pool, unit_id: str, open_peer, *, read_rate: float = 0,
                 window_bytes: int = WINDOW_BYTES, sleep=time.sleep):
        self.pool, self.unit_id, self.open_peer = Path(pool), unit_id, open_peer
        self.layout = PoolLayout(pool)
        self.maps = ReplicaMaps(self.layout, unit_id)
        self.pacer = ReadPacer(read_rate)
        self.window_bytes, self.sleep = window_bytes, sleep
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp = self.layout.verify_tmp(unit_id, self.run_id)
        self.found = Findings()
        self.notes: list[str] = []
        self.st0 = None
        self.recorded = False
        self.primary: dict | None = None
        self.windows = 0
        self.end_generation = 0
        self.points: dict | None = None

    # -- the run -------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.time()
        complete = True
        self._clear_leftovers()
        self.tmp.mkdir(parents=True)
        try:
            self._begin()
            for vol in self.st0.members:
                self._member(vol)
            self.points = PointsCheck(self, self.window_bytes).run()
        except Stopped as e:
            complete = False
            self.notes.append(str(e))
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self._outcome(t0, complete)

    def _clear_leftovers(self) -> None:
        """Remove the scratch of runs whose process is gone (a verify killed part-way)."""
        root = self.layout.verify_tmp(self.unit_id)
        for d in root.iterdir() if root.is_dir() else ():
            pid = d.name.split("-", 1)[0]
            if not (pid.isdigit() and _alive(int(pid))):
                shutil.rmtree(d, ignore_errors=True)

    def _outcome(self, t0: float, complete: bool) -> dict:
        f, pts = self.found, self.points
        replica = "mismatch" if f.blocks else (
            "clean" if complete and (self.recorded or self.primary is not None) else "incomplete")
        if replica == "incomplete" and complete:
            self.notes.append("nothing to compare with: no recorded block map and the primary did not answer")
        if pts and pts["unverifiable"]:
            self.notes.append("unverifiable (no digests): " + ", ".join(
                f"point {u['point']} of {u['volume']} ({u['bytes']} bytes)" for u in pts["unverifiable"][:NAMED]))
        result = "mismatch" if pts and pts["damaged_points"] else replica
        named = f.named[:NAMED] + (pts["damaged"] if pts else [])[:max(0, NAMED - len(f.named))]
        return {"unit_id": self.unit_id, "generation": self.st0.generation,
                "end_generation": self.end_generation or self.st0.generation,
                "started_at": t0, "finished_at": time.time(), "duration_s": round(time.time() - t0, 3),
                "result": result, "replica_result": replica, "complete": complete, "mismatched_blocks": f.blocks,
                "mismatches": named, "points": pts, "repair_runs": f.runs if f.blocks else {},
                "checked": {"recorded": self.recorded, "primary": self.primary is not None},
                "skipped_blocks": f.skipped, "bytes_read": self.pacer.done, "windows": self.windows,
                "read_rate": self.pacer.rate, "notes": self.notes}

    def _begin(self) -> None:
        """The generation to verify, a copy of the recorded maps as they describe it, and the
        primary's maps of it. The primary answers only between its own syncs, and only while it
        holds this generation as acked: a sync in flight (its unit locked, or its ack not yet
        recorded) is waited out, re-reading this site's generation, for PRIMARY_PATIENCE."""
        deadline = time.monotonic() + PRIMARY_PATIENCE
        delay = 0.1
        while True:
            st = self._take_start()
            try:
                self.primary = self._primary_maps(st)
                return
            except (ReplicationConflict, OperationInProgress) as e:
                if time.monotonic() + delay > deadline:
                    self.notes.append(f"not compared with the primary: {e.message}")
                    return
            except DrsvcError as e:
                self.notes.append(f"not compared with the primary: {e.message}")
                return
            time.sleep(delay * (0.5 + secrets.randbelow(1000) / 2000))   # not in step with a schedule
            delay = min(2 * delay, 2.0)

    def _take_start(self):
        """Under the unit's lock: this site's generation, and a copy of its recorded maps."""
        with self._lock():
            recover(self.layout, self.unit_id)
            st = get_state(self.pool, self.unit_id)
            if st.role != "secondary":
                raise NotSecondary(kind="unit", unit_id=self.unit_id)
            if st.generation == 0:
                raise ReplicationConflict(unit_id=self.unit_id, reason="nothing received yet to verify")
            self.st0, self.recorded = st, self.maps.recorded_for(st)
            if self.recorded:
                for vol in st.members:
                    start = self.tmp / f"{vol}.start.map"
                    start.unlink(missing_ok=True)       # a later attempt: the earlier one's copy
                    copy_map(self.maps.path(vol), start)
            return st

    def _primary_maps(self, st) -> dict:
        peer = self.open_peer()
        try:
            # the verify's read cap holds at the primary too (its snapshot's reads)
            rate = [str(int(self.pacer.rate))] if self.pacer.rate > 0 else []
            chan = peer.open("snaphashes", self.unit_id, str(st.generation), *rate)
            try:
                chan.close_write()
                return read_maps(reader_for(peer, chan), self.tmp, st.block_size)
            finally:
                chan.close()
        finally:
            peer.close()

    def _lock(self):
        """The unit's lock, waited for past one long sync (UnitLock waits 30 s a try)."""
        deadline = time.monotonic() + LOCK_PATIENCE
        while True:
            lock = UnitLock(self.layout, self.unit_id)
            try:
                lock.__enter__()
                return _Held(lock)
            except OperationInProgress:
                if time.monotonic() > deadline:
                    raise Stopped(f"the unit stayed locked by syncs for {LOCK_PATIENCE:.0f}s") from None

    # -- one member ------------------------------------------------------------------------
    def _member(self, vol: str) -> None:
        st0, bs = self.st0, self.st0.block_size
        size = int(st0.sizes.get(vol) or os.stat(self.layout.image(vol)).st_size)
        start = BlockMap.open(self.tmp / f"{vol}.start.map") if self.recorded else None
        pmap = self._primary_map(vol, size)
        fd = os.open(self.layout.image(vol), os.O_RDONLY)
        buf = bytearray(max(bs, READ_BUF - READ_BUF % bs))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for first, count in plan_windows(size, bs, self.window_bytes):
                fd = self._window(vol, fd, first, count, size, buf, start, pmap)
        finally:
            os.close(fd)
            for m in (start, pmap):
                if m is not None:
                    m.close()

    def _primary_map(self, vol: str, size: int) -> BlockMap | None:
        if self.primary is None:
            return None
        exists, psize, path = self.primary.get(vol, (False, 0, None))
        if not exists or psize != size:
            self.found.whole(vol, size, self.st0.block_size, "primary", self.st0.generation,
                             f"the primary's snapshot has {'no image' if not exists else f'size {psize}'}")
            return None
        return BlockMap.open(path)

    def _window(self, vol, fd, first, count, size, buf, start, pmap) -> int:
        with self._lock():
            st = get_state(self.pool, self.unit_id)
            moved = st.generation != self.st0.generation
            if st.role != "secondary" or vol not in st.members or int(st.sizes.get(vol) or size) != size:
                raise Stopped(f"{vol} changed during the verify (role {st.role}, generation {st.generation})")
            recorded = self.recorded and (not moved or self.maps.recorded_for(st))
            if moved and pmap is not None and not recorded:
                raise Stopped(f"a sync moved {self.unit_id} to generation {st.generation} and no recorded "
                              "block map says which blocks it rewrote")
            fd = self._same_image(vol, fd)
            actual, nread = hash_range(fd, first, count, self.st0.block_size, size, buf)
            now = self._recorded_slots(vol, first, count) if recorded else None
        self.end_generation, self.windows = st.generation, self.windows + 1
        v = compare_window(actual, now, pmap.read(first, count) if pmap is not None else None,
                           start.read(first, count) if moved and start is not None else None)
        self.found.add(vol, first, size, self.st0.block_size, v, recorded_generation=st.generation,
                       primary_generation=self.st0.generation)
        self.sleep(self.pacer.delay(nread))
        return fd

    def _same_image(self, vol: str, fd: int) -> int:
        """The image as it is now (a fresh member's image is renamed in at its commit)."""
        path = self.layout.image(vol)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
        os.close(fd)
        return os.open(path, os.O_RDONLY)

    def _recorded_slots(self, vol: str, first: int, count: int) -> bytes:
        with BlockMap.open(self.maps.path(vol)) as m:
            return m.read(first, count)


class _Held:
    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lock.__exit__(*exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
