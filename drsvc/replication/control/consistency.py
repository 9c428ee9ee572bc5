"""Consistency judged by content: a replica's block hashes against the primary's.

Generation numbers say which delta a replica applied; they cannot see a write
made to the image afterwards (a stale filesystem flushed at unstage, say). So
before a secondary says it is consistent (ResyncVolume ready=true), it hashes
its own images and compares them, block for block, with the primary's acked
snapshot of the same generation. The primary serves those hashes through one
receiver verb, ``snaphashes UNIT GENERATION`` (``verbs.snapshot_hashes``): the
snapshot, not the live image, because the application keeps writing there; or,
while the peer is a secondary too (between a planned demote and the promote),
its replica image.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from ... import store
from ...errors import DrsvcError
from ...layout import PoolLayout
from ..common.blockmap import BlockMap, hash_image
from ..common.unit_state import find_state, get_state, mark_diverged, request_resync
from ..sender.receiver_client import ask_soon, read_maps, reader_for

log = logging.getLogger(__name__)

# A copy that still waits on the primary's sync asks for it again at most this often
# (ResyncVolume is polled; a sync that met an error meanwhile is asked for once more).
ASK_AGAIN_S = 60.0
_asked_at: dict[str, float] = {}      # unit id -> when this process last asked its primary


@dataclass
class ContentCheck:
    generation: int
    differing: dict = field(default_factory=dict)     # volume_id -> reason

    @property
    def equal(self) -> bool:
        return not self.differing


def _same_map(local: BlockMap, remote: BlockMap, blocks: int) -> bool:
    step = 1 << 16
    return all(local.read(first, min(step, blocks - first)) == remote.read(first, min(step, blocks - first))
               for first in range(0, blocks, step))


def compare_with_primary(pool, unit_id: str, peer) -> ContentCheck:
    """Hash this site's replica images and compare them with the primary's snapshot
    of the generation this site holds. Holds the unit lock, so no delta lands meanwhile."""
    layout = PoolLayout(pool)
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        st = get_state(pool, unit_id)
        check = ContentCheck(st.generation)
        tmp = tempfile.mkdtemp(prefix="drsvc-content-", dir=layout.unit_dir(unit_id))
        try:
            chan = peer.open("snaphashes", unit_id, str(st.generation))
            try:
                chan.close_write()
                maps = read_maps(reader_for(peer, chan), tmp, st.block_size)
            finally:
                chan.close()
            for vol in st.members:
                exists, psize, ppath = maps.get(vol, (False, 0, None))
                image = layout.image(vol)
                if not exists or not image.exists():
                    check.differing[vol] = "missing on one side"
                    continue
                fd = os.open(image, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    if size != psize:
                        check.differing[vol] = f"size {size}, the primary's is {psize}"
                        continue
                    with BlockMap.create(os.path.join(tmp, f"{vol}.local.map"), st.block_size, size) as local:
                        for first, digests in hash_image(fd, size, st.block_size):
                            local.write(first, digests)
                        with BlockMap.open(ppath) as remote:
                            if not _same_map(local, remote, local.blocks):
                                check.differing[vol] = "block hashes differ"
                finally:
                    os.close(fd)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return check


def state_says_consistent(pool, unit_id: str) -> bool:
    st = find_state(pool, unit_id)
    return st is not None and st.role == "secondary" and not (st.diverged or st.resync_requested)


def resync_step(pool, unit_id: str, *, force: bool, open_peer) -> dict:
    """One ResyncVolume at a secondary. ready=True only when the replica's content equals
    the primary's snapshot of the same generation. A replica that differs (diverged
    writes, or content found different) is overwritten by the primary's compare sync
    only when *force* is set; without it the data is left alone and ready stays False."""
    st = get_state(pool, unit_id)
    if st.resync_requested:
        if time.monotonic() - _asked_at.get(unit_id, float("-inf")) >= ASK_AGAIN_S:
            ask_primary_soon(open_peer, unit_id)
        return {"ready": False, "reason": "waiting for the primary's compare sync"}
    if not st.diverged:
        peer = None
        try:
            peer = open_peer()
            check = compare_with_primary(pool, unit_id, peer)
        except DrsvcError as e:          # a delta landing, the peer away: not provable now
            return {"ready": False, "reason": f"content not verified: {e.message}"}
        finally:
            if peer is not None:
                peer.close()
        if check.equal:
            return {"ready": True, "generation": check.generation}
        log.warning("replica %s differs from the primary's generation %d (%s): marked diverged",
                    unit_id, check.generation, check.differing)
        mark_diverged(pool, unit_id, True)
    if not force:
        return {"ready": False, "reason": "the replica holds data the primary does not; "
                                          "ResyncVolume with force discards it"}
    request_resync(pool, unit_id)
    ask_primary_soon(open_peer, unit_id)
    return {"ready": False, "reason": "resync requested"}


def ask_primary_soon(open_peer, unit_id: str) -> bool:
    """Ask the primary for its next sync of the unit now: a resync (or a repair) is done by
    that sync, and waiting for its slot would take up to a whole interval. Never fails the
    caller: a primary away, or of a release without the ``soon`` verb, ships it on its
    schedule. True when the primary's scheduler was asked (False: asked already, or the
    peer is not primary)."""
    _asked_at[unit_id] = time.monotonic()
    peer = None
    try:
        peer = open_peer()
        return bool(ask_soon(peer, unit_id).get("asked"))
    except (DrsvcError, OSError) as e:
        log.info("%s: the primary was not asked for its next sync now (%s); it comes at its slot",
                 unit_id, e.message if isinstance(e, DrsvcError) else type(e).__name__)
        return False
    finally:
        if peer is not None:
            peer.close()
