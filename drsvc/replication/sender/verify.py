"""Verify: compare block hashes of the acked snapshot with the peer's replica."""
from __future__ import annotations

import os
import shutil
import tempfile

from ... import store
from ...errors import ReplicationConflict
from ...layout import PoolLayout
from ..common.blockmap import DIGEST, BlockMap, hash_image
from ..common.unit_state import get_state
from . import changes as planner
from .base_store import ensure_whole_base
from .receiver_client import fetch_maps, peer_status
from .reports import VerifyReport

WINDOW = 1 << 16   # blocks compared per step


def differing_ranges(a: BlockMap, b: BlockMap, size: int, bs: int) -> list[list[int]]:
    """Byte ranges [offset, length] whose digests differ between two maps."""
    out: list[list[int]] = []
    blocks = -(-size // bs)
    for first in range(0, blocks, WINDOW):
        n = min(WINDOW, blocks - first)
        da, db = a.read(first, n), b.read(first, n)
        if da == db:
            continue
        for blk, count, _z in planner.changed_runs(da, db, first):
            off = blk * bs
            length = min(count * bs, size - off)
            if out and out[-1][0] + out[-1][1] == off:
                out[-1][1] += length
            else:
                out.append([off, length])
    return out


def verify_unit(pool, unit_id: str, peer, *, block_size: int | None = None) -> VerifyReport:
    """Hash the last acknowledged snapshot of every member and the peer's replica; name
    the differing ranges. The unit's lock is held so no sync replaces the snapshot."""
    layout = PoolLayout(pool)
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id):
        st = get_state(pool, unit_id)
        if st.generation == 0:
            raise ReplicationConflict(unit_id=unit_id, reason="nothing acknowledged yet")
        bs = block_size or st.block_size
        ensure_whole_base(layout, unit_id, st.generation)
        snap = layout.snap_dir(unit_id, st.generation)
        peer_st = peer_status(peer, unit_id)
        rep = VerifyReport(unit_id=unit_id, generation=st.generation,
                           peer_generation=int(peer_st.get("generation") or 0))
        tmp = tempfile.mkdtemp(prefix="drsvc-verify-", dir=layout.unit_dir(unit_id))
        try:
            maps = fetch_maps(peer, unit_id, st.members, bs, tmp)
            for vol in st.members:
                fd = os.open(PoolLayout.member_image(snap, vol), os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    with BlockMap.create(os.path.join(tmp, f"{vol}.local.map"), bs, size) as local:
                        for first, digests in hash_image(fd, size, bs):
                            local.write(first, digests)
                        exists, psize, ppath = maps.get(vol, (False, 0, None))
                        if not exists:
                            rep.members[vol] = {"size": size, "peer_size": None, "differs": [[0, size]]}
                            continue
                        with BlockMap.open(ppath) as remote:
                            rep.members[vol] = {"size": size, "peer_size": psize,
                                                "differs": differing_ranges(local, remote, max(size, psize), bs)}
                finally:
                    os.close(fd)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return rep


__all__ = ["verify_unit", "differing_ranges", "DIGEST"]
