"""The bodies of the receiver's verbs (the table that allows them is ``program.VERBS``).

Each is ``verb(layout, reader, out, args)``: *args* are already counted against
the table's bounds; every id is checked here before a path is built. A verb
that touches a unit holds its lock (``replica.UnitLock``) and first finishes a
committed journal (``replica.recover``).
"""
from __future__ import annotations

import os
import time

from ... import schedule_changes, store
from ...errors import (
    InvalidParameter,
    ProtocolError,
    ReplicaIsPrimary,
    ReplicationConflict,
    StreamCorrupt,
    UnitNotFound,
)
from ...layout import PoolLayout, check_id
from ..common.blockmap import DIGEST, check_block_size, hash_image
from ..common.read_pacer import ReadPacer
from ..common.unit_state import find_state, get_state
from ..wire import frames
from ..wire.frames import T_CONTROL, FrameReader
from .journal import Journal
from .replica import UnitLock, recover, settle, status_of
from .transaction import Replies, Transaction, parse_tx


def status(layout: PoolLayout, reader: FrameReader, out: Replies, args: list[str]) -> None:
    unit_id = check_id(args[0])
    with UnitLock(layout, unit_id, for_peer=True):
        out.control(status_of(layout, unit_id, recover(layout, unit_id)))


def soon(layout: PoolLayout, reader: FrameReader, out: Replies, args: list[str]) -> None:
    """The peer's copy waits on this site's next sync of the unit (a resync that discards its
    divergence, a repair its verify asked for): the scheduler here moves that sync to now
    (``schedule_changes.ask_soon``). Only a primary syncs, so elsewhere nothing is asked."""
    unit_id = check_id(args[0])
    st = find_state(layout.root, unit_id)
    if st is None:
        raise UnitNotFound(unit_id=unit_id)
    if st.role != "primary":
        out.control({"type": "soon", "asked": False, "reason": f"{unit_id} is {st.role} at this site"})
        return
    out.control({"type": "soon", "asked": schedule_changes.ask_soon(layout.root, unit_id)})


def _send_map(out: Replies, vol: str, fd: int, block_size: int, pacer: ReadPacer | None = None) -> None:
    size = os.fstat(fd).st_size
    out.control({"type": "map", "volume_id": vol, "exists": True, "size": size, "block_size": block_size})
    for first, digests in hash_image(fd, size, block_size):
        out.write(frames.encode_hashes(first, digests))
        if pacer is not None:
            time.sleep(pacer.delay(len(digests) // DIGEST * block_size))
    out.control({"type": "end", "volume_id": vol})


def send_hashes(layout: PoolLayout, out: Replies, block_size: int, volumes) -> None:
    """Block hash maps of replica images (an absent image: a map that does not exist)."""
    check_block_size(block_size)
    for vol in volumes:
        try:
            fd = os.open(layout.image(vol), os.O_RDONLY)
        except FileNotFoundError:
            out.control({"type": "map", "volume_id": vol, "exists": False, "size": 0,
                         "block_size": block_size})
            continue
        try:
            _send_map(out, vol, fd, block_size)
        finally:
            os.close(fd)
    out.control({"type": "done"})


def hashes(layout: PoolLayout, reader: FrameReader, out: Replies, args: list[str]) -> None:
    unit_id = check_id(args[0])
    try:
        block_size = int(args[1])
    except ValueError:
        raise InvalidParameter(key="block_size", reason="not an integer") from None
    volumes = [check_id(v, "volume id") for v in args[2:]]
    with UnitLock(layout, unit_id):
        recover(layout, unit_id)
        if not volumes:
            st = find_state(layout.root, unit_id)
            if st is None:
                raise UnitNotFound(unit_id=unit_id)
            volumes = st.members
        send_hashes(layout, out, block_size, volumes)


def snapshot_hashes(layout: PoolLayout, reader: FrameReader, out: Replies, args: list[str]) -> None:
    """Block hashes of the acked snapshot of generation GENERATION, every member (served by
    the primary, read by a secondary's content check: ``control.consistency``, and its
    verify: ``control.scrub``). RATE (bytes per second, optional; 0: none) caps the reads: a
    verify's cap holds at the primary too. The snapshot's images are opened under the unit's
    lock and read after it is let go (an acked snapshot is never written, and an open file
    outlives its removal), so a capped read never holds up the primary's syncs."""
    unit_id = check_id(args[0])
    try:
        generation = int(args[1])
        rate = int(args[2]) if len(args) > 2 else 0
    except ValueError:
        raise ReplicationConflict(unit_id=unit_id, reason="generation and rate are integers") from None
    if rate < 0:
        raise InvalidParameter(key="rate", reason="a read rate is 0 (none) or more bytes per second")
    layout.ensure_unit_dir(unit_id)
    opened: list = []
    try:
        block_size = _snapshot_fds(layout, unit_id, generation, out, opened)
        pacer = ReadPacer(rate) if rate else None
        for vol, fd in opened:
            _send_map(out, vol, fd, block_size, pacer)
        out.control({"type": "done"})
    finally:
        for _vol, fd in opened:
            os.close(fd)


def _snapshot_fds(layout: PoolLayout, unit_id: str, generation: int, out: Replies, opened: list) -> int:
    """Under the unit's lock: check the generation is held, and open every member's image of
    it into *opened* (a replica held as secondary is hashed right here, under the lock, and
    uncapped: it may be written once the lock goes). Returns the unit's block size."""
    # not waited for: the sync that holds it may itself be waiting on the asker's lock
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        if find_state(layout.root, unit_id) is not None and get_state(layout.root, unit_id).role != "primary":
            recover(layout, unit_id)             # a committed journal is applied first
        st = get_state(layout.root, unit_id)
        if st.role == "primary":                 # the acked snapshot, not the live image
            # whole once the roll behind the sync that acked it is done (it takes no other lock)
            with store.file_lock(layout.roll_lock_path(unit_id), key=unit_id):
                pass
            snap = layout.snap_dir(unit_id, generation)
            path_of = lambda vol: snap / f"{check_id(vol, 'volume id')}.img"   # noqa: E731
            held = (snap / "meta.json").exists()
        else:                                    # both secondary (a planned relocate): the replica
            path_of = layout.image
            held = not st.diverged and not st.resync_requested
        if st.generation != generation or not held:
            raise ReplicationConflict(unit_id=unit_id, reason=f"generation {generation} is not held here as "
                                                              f"acked (this site is at {st.generation})")
        for vol in st.members:
            opened.append((vol, os.open(path_of(vol), os.O_RDONLY)))
        if st.role != "primary":
            while opened:
                vol, fd = opened.pop(0)
                try:
                    _send_map(out, vol, fd, st.block_size)
                finally:
                    os.close(fd)
        return st.block_size


def release(layout: PoolLayout, reader: FrameReader, out: Replies, args: list[str]) -> None:
    unit_id = check_id(args[0])
    how = args[1] if len(args) > 1 else "keep-image"
    if how not in ("keep-image", "delete-image"):
        raise InvalidParameter(key="release", reason="keep-image or delete-image")
    with UnitLock(layout, unit_id):
        recover(layout, unit_id).discard()
        st = find_state(layout.root, unit_id)
        removed = []
        if st is not None and how == "delete-image":
            if st.role == "primary":
                raise ReplicaIsPrimary(unit_id=unit_id)
            for vol in st.members:
                if store.remove(layout.image(vol)):
                    removed.append(vol)
        if st is not None:
            store.remove(layout.state_path(unit_id))
    # the lock file goes last, outside the lock
    store.remove_tree(layout.unit_dir(unit_id), ignore_errors=True)
    out.control({"type": "released", "unit": unit_id, "existed": st is not None,
                 "removed_images": removed})


def apply(layout: PoolLayout, reader: FrameReader, out: Replies, args: list[str]) -> None:
    ApplyConversation(layout, reader, out).run()


class ApplyConversation:
    """The `apply` verb: status and block-map requests about one unit, its transaction and a
    round's decision, until ``bye`` or the end of input. The unit's lock is taken at the
    first message naming it (a committed journal is finished then) and held to the end,
    except after a Demote's final transaction commits: the sender, about to be secondary,
    sends nothing more but its ``bye``, which is half a round trip away and comes after its
    adopt. The lock is let go with the ``committed`` answer, so a Promote here, which the CO
    sends as soon as the Demote returns, does not wait for that ``bye`` (it waited 34-51 ms at
    100 ms RTT). A message after that takes the lock again."""

    def __init__(self, layout: PoolLayout, reader: FrameReader, out: Replies):
        self.layout, self.reader, self.out = layout, reader, out
        self.unit_id: str | None = None
        self.lock: UnitLock | None = None
        self.journal: Journal | None = None
        self.handlers = {"status": self.status, "hashes": self.hashes, "begin": self.begin,
                         "decide": self.decide}

    def run(self) -> None:
        try:
            while True:
                frame = self.reader.next_frame(eof_ok=True)
                if frame is None:
                    return
                ftype, body = frame
                if ftype != T_CONTROL:
                    raise StreamCorrupt(reason="record outside a transaction")
                msg = frames.parse_control(body)
                if msg["type"] == "bye":
                    return
                handler = self.handlers.get(msg["type"])
                if handler is None:
                    raise ProtocolError(reason=f"unexpected control message {msg['type']!r}")
                handler(msg)
        finally:
            self._unlock()

    def _unit(self, msg: dict) -> str:
        """The session's unit: the first message names it (and takes its lock); the rest must too."""
        uid = check_id(msg.get("unit"))
        if self.unit_id is None:
            self.unit_id = uid
        elif uid != self.unit_id:
            raise ProtocolError(reason="one unit per apply session")
        self._lock()
        return uid

    def _lock(self) -> None:
        if self.lock is None:
            self.lock = UnitLock(self.layout, self.unit_id, for_peer=True).__enter__()
            self.journal = recover(self.layout, self.unit_id)

    def _unlock(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None

    def status(self, msg: dict) -> None:
        unit_id = self._unit(msg)
        self.out.control(status_of(self.layout, unit_id, self.journal))

    def hashes(self, msg: dict) -> None:
        self._unit(msg)
        vols = [check_id(v, "volume id") for v in msg.get("volumes", [])]
        send_hashes(self.layout, self.out, int(msg["block_size"]), vols)

    def begin(self, msg: dict) -> None:
        self._unit(msg)
        t = Transaction(self.layout, parse_tx(msg), self.journal)
        self.journal = t.run(self.reader, self.out)
        if t.committed and t.tx["demote"]:      # nothing more comes but the bye
            self._unlock()

    def decide(self, msg: dict) -> None:
        if self.unit_id is None or msg.get("unit") != self.unit_id:
            raise ProtocolError(reason="decide names the session's unit")
        self._lock()
        if self.journal is not None:
            self.journal.close()
        self.out.control(settle(self.layout, self.unit_id, check_id(msg.get("txid"), "transaction id"),
                                msg.get("commit") is True))
        self.journal = Journal(self.layout, self.unit_id)
