"""The recovery point's undo copy, made while the records arrive.

A commit keeps what it overwrites (``commit_points.keep_overwritten``): the replica's bytes
under each record, copied into the undo log of the newest point before the apply writes
the replica. Made at the commit, after the last record, that copy would be a large share
of the apply, on the path of the answer. The replica cannot change before the commit (the
unit lock is held, the images are not in use), so the same bytes can be copied as each
record arrives: :class:`UndoAhead` takes the records' spans and copies them on a thread of its
own, in batches, into the newest point's undo log.

No map names the copies until the commit: they are appended, durably, after what the
point's map names (for a member the replica still holds live, nothing), and the map that
names them is handed in memory to ``keep_overwritten`` (:meth:`UndoAhead.finish`), which
copies only what is still missing and writes the map with the point's new state. A crash,
an abort or a replay in another process finds bytes past the map's end, which the next
append cuts off (``undo_log.append(after=...)``): they are copied again, never trusted.

Only the newest point gets early copies, when the retention grid keeps it with this commit
(``commit_points.undo_target``), and only for members it holds live (the replica is that
point's bytes); only a one-phase delta transaction makes them. Any error here
drops the early copies (logged): the commit then copies everything itself.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass

from ...failpoints import failpoint
from ...layout import PoolLayout
from ...logs import logger
from ..common import ranges
from ..points import undo_log
from ..points.index import LIVE, Index, ensure_point_dir, member_data, read_meta
from .commit_points import keeps_undo, undo_target

log = logger(__name__)

BATCH_RANGES = 512      # a batch is copied once this many spans wait,
BATCH_WAIT = 0.02       # or this long after the first of them arrived


@dataclass
class Early:
    """What the early copy of one member holds: the point, and its undo map's rows."""
    generation: int
    rows: object            # undo_log map: (offset, length, log position) rows
    nbytes: int


class UndoAhead:
    """Early undo copies of one transaction (see the module's doc). ``want`` is called for
    every record (from the channels' threads); ``finish`` before the commit marker."""

    def __init__(self, layout: PoolLayout, tx: dict):
        self.layout, self.tx = layout, tx
        self.members = tx["members"]
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._first_at = 0.0
        self.error: BaseException | None = None
        self.copied: dict[str, Early] = {}     # volume id -> its early copies (by the thread)
        self.busy_s = 0.0                      # the thread's time copying

    @classmethod
    def wanted(cls, layout: PoolLayout, tx: dict) -> UndoAhead | None:
        """One for the transaction, when an early copy can pay: a one-phase delta into a
        unit that keeps recovery points, with a member that has a base, answered once
        applied (a durable ``ack`` copies after its answer: made during the stream, the copy
        would take the disk from the journal's writes, which that answer waits for)."""
        if tx["mode"] != "delta" or tx["two_phase"] or all(m["fresh"] for m in tx["members"]):
            return None
        if tx.get("ack") == "durable" and not tx["demote"]:
            return None
        if not keeps_undo(layout, tx["unit"]):
            return None
        return cls(layout, tx)

    def want(self, member: int, offset: int, length: int) -> None:
        with self._cv:
            if self._stopped:
                return
            if not self._q:
                self._first_at = time.monotonic()
            self._q.append((member, offset, length))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drsvc-undo-ahead", daemon=True)
                self._thread.start()
            if len(self._q) >= BATCH_RANGES:
                self._cv.notify()

    def _take(self) -> list | None:
        """(the thread) The next batch; None once stopped with nothing left."""
        with self._cv:
            while True:
                if self._q and (self._stopped or len(self._q) >= BATCH_RANGES
                                or time.monotonic() - self._first_at >= BATCH_WAIT):
                    batch = list(self._q)
                    self._q.clear()
                    return batch
                if self._stopped:
                    return None
                self._cv.wait(BATCH_WAIT if self._q else None)

    def _run(self) -> None:
        targets: dict = {}
        try:
            targets = self._targets()
            while (batch := self._take()) is not None:
                if targets:
                    t = time.monotonic()
                    self._copy(targets, batch)
                    self.busy_s += time.monotonic() - t
                    failpoint("points.mid_undo_ahead")   # copies past the map's end, no commit yet
        except BaseException as e:  # noqa: BLE001 - the commit copies everything instead
            self.error = e
            with self._cv:
                self._stopped = True
                self._q.clear()
        finally:
            for t in targets.values():
                os.close(t["fd"])

    def _targets(self) -> dict:
        """member index -> what its early copies need: the newest point holds it live."""
        idx = Index.find(self.layout, self.tx["unit"])
        if idx is None or idx.newest is None or idx.has_txid(self.tx["txid"]):
            return {}
        newest = idx.newest
        if undo_target(idx, self.tx) is not newest:
            return {}           # the grid drops the newest point with this commit: nothing to keep there
        meta = read_meta(self.layout, idx.unit_id, newest.generation)
        out = {}
        for i, m in enumerate(self.members):
            vol = m["volume_id"]
            if m["fresh"] or vol not in newest.members or member_data(meta, vol) != LIVE:
                continue
            try:
                fd = os.open(self.layout.image(vol), os.O_RDONLY)
            except FileNotFoundError:
                continue
            out[i] = {"vol": vol, "fd": fd, "size": os.fstat(fd).st_size, "generation": newest.generation,
                      "log": self.layout.point_undo(idx.unit_id, newest.generation, vol),
                      "sums": self.layout.point_undo_sums(idx.unit_id, newest.generation, vol)}
        if out:
            ensure_point_dir(self.layout, idx.unit_id, newest.generation)
        return out

    def _copy(self, targets: dict, batch: list) -> None:
        changed = undo_log.changed_ranges(batch, self.tx)     # as the commit reckons them
        for t in targets.values():
            if t["vol"] not in changed:
                continue
            early = self.copied.get(t["vol"])
            have = early.rows if early is not None else undo_log.no_map()
            want = ranges.subtract(changed[t["vol"]], undo_log.covered(have))
            if not len(want[0]):
                continue
            rows, n = undo_log.append(t["log"], undo_log.image_pieces(t["fd"], want, t["size"]), after=have,
                                      sums=t["sums"])
            self.copied[t["vol"]] = Early(t["generation"], undo_log.merge_maps(have, rows),
                                          n + (early.nbytes if early is not None else 0))

    def _stop(self) -> None:
        with self._cv:
            self._stopped = True
            th = self._thread
            self._cv.notify_all()
        if th is not None:
            th.join()

    def finish(self) -> dict[str, Early]:
        """Every record is in: copy what is left, and return volume id -> its early copies
        (empty when the copy failed: the commit copies it all)."""
        self._stop()
        if self.error is not None:
            log.warning("unit %s: the undo copy ahead of the commit failed (%s); the commit copies it",
                        self.tx["unit"], self.error)
            return {}
        return dict(self.copied)

    def close(self) -> None:
        """The transaction ended without a commit here: stop (what was copied stays past the
        map's end, cut off by the next append)."""
        self._stop()
