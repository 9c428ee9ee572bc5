"""A generation prepared for sending: its directory and its ``meta.json``.

The one type the sender's rooms hand each other (the driver's ``Attempt``, the
steps, prepare, the snapshot store, stream). A leaf: it imports nothing of the
engine.

    snap/tmp-<txid>/   being captured and planned (ours alone; swept at the next sync)
    snap/<G+1>/        the intent: this generation may be on the wire
    snap/<G>/          the acked base

A generation may still be planning when it is handed over (``Planning``): its capture
is done, its intent recorded, and its plan's entries come through a :class:`PlanFeed` as
they are written, so the stream can send records while the plan still reads. ``settle()``
waits for the plan.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


class PlanCancelled(Exception):
    """The plan was stopped: nobody will send what it would have planned."""


class PlanFeed:
    """Plan entries (member, is_zero, offset, length, checksum), from the thread writing the
    plan to the one reading them for the wire, in plan order. Iterating blocks until the
    next entry or the end; a plan that failed raises its error there."""

    IDLE = 0.002    # a plan this slow to give the next entry lets the reader send what it has
    WAIT = 0.05     # a missed wake-up costs at most this

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._waiting = False
        self._ended = False
        self._error: BaseException | None = None
        self.cancelled = False      # the plan stops at its next entry
        self.detached = False       # the reader is gone; the plan goes on, into its file alone

    def put(self, entry: tuple) -> None:
        if self.cancelled:
            raise PlanCancelled()
        if self.detached:
            return
        self._items.append(entry)
        if self._waiting:
            with self._cv:
                self._cv.notify()

    def end(self, error: BaseException | None = None) -> None:
        with self._cv:
            self._error, self._ended = error, True
            self._cv.notify_all()

    def cancel(self) -> None:
        """The plan's next entry raises :class:`PlanCancelled`, and so does a reader waiting."""
        self.cancelled = True
        self.detach()

    def detach(self) -> None:
        """The reader stops (a waiting one raises :class:`PlanCancelled`); the plan goes on."""
        self.detached = True
        self._items.clear()
        with self._cv:
            self._cv.notify_all()

    def __iter__(self) -> Iterator[tuple | None]:
        """The entries in order; ``None`` once whenever the plan has kept the reader waiting
        ``IDLE`` seconds (the reader sends what it batched rather than wait with it)."""
        items = self._items
        idle_said = False
        while True:
            while items:
                idle_said = False
                yield items.popleft()
            with self._cv:
                self._waiting = True
                try:
                    if not items and not self._ended and not self.detached:
                        self._cv.wait(self.WAIT if idle_said else self.IDLE)
                finally:
                    self._waiting = False
            if self.detached:
                raise PlanCancelled()
            if not items:
                if self._ended:
                    if self._error is not None:
                        raise self._error
                    return
                if not idle_said:
                    idle_said = True
                    yield None


class Planning:
    """A plan being written on a thread of its own; its entries come through ``feed``."""

    def __init__(self, run: Callable[[PlanFeed], None], name: str):
        self.feed = PlanFeed()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name=name, daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[PlanFeed], None]) -> None:
        try:
            run(self.feed)
        except BaseException as e:   # noqa: BLE001 - raised by join(), and to the feed's reader
            self.error = e
        self.feed.end(self.error)

    def join(self) -> None:
        """Wait for the plan; raise its error."""
        self._thread.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Cancel the plan and wait for its thread; its error, if any, is dropped."""
        self.feed.cancel()
        self._thread.join()


@dataclass
class Prepared:
    dir: Path
    meta: dict
    planning: Planning | None = None     # the plan still being written (its meta completes when done)
    # an early plan's (``capture_feed``): whether a member's range is planned again after its first
    # records, which the stream may then read changed (member index, offset, length) -> bool
    moved: Callable[[int, int, int], bool] | None = None

    def settle(self) -> None:
        """Wait until the plan is written (``meta.json`` complete); raise what stopped it."""
        if self.planning is not None:
            planning, self.planning = self.planning, None
            planning.join()

    def stop(self) -> None:
        """Stop a plan still being written. Its generation stays as it is: a pending one,
        whose ``meta.json`` is not complete, is planned again at the next sync
        (``prepare.replan``)."""
        if self.planning is not None:
            planning, self.planning = self.planning, None
            planning.stop()

    def member_file(self, member: dict) -> Path:
        """The file a member's records are read from: its overlay, or its whole image."""
        vol = member["volume_id"]
        if member.get("overlay") and not (self.dir / f"{vol}.img").exists():
            return self.dir / f"{vol}.delta"
        return self.dir / f"{vol}.img"
