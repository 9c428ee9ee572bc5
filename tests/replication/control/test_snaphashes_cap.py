"""The primary's reads for a verify keep the verify's read cap: ``snaphashes UNIT GENERATION
RATE``, served by the real receiver program over a local peer, reads the acked snapshot at
no more than RATE (a ratio to the cap, measured from the asker's side, which starts first
and ends last), and the same request uncapped in the same run reads faster than the cap, so
the cap is what held it. The unit's lock is let go while it reads: a sync of the same unit
runs to its end during a capped read."""
from __future__ import annotations

import os
import threading
import time

from drsvc.layout import PoolLayout
from drsvc.replication import sync_unit
from drsvc.replication.sender.receiver_client import read_maps, reader_for
from drsvc.transport.local import LocalPeer

from ..conftest import make_image, new_sites, write_at

MiB = 1 << 20
DATA = 24 * MiB
CAP = 6 * MiB


def _snaphashes(pool, unit: str, generation: int, dest, *rate) -> float:
    peer = LocalPeer(pool)
    t0 = time.monotonic()
    try:
        chan = peer.open("snaphashes", unit, str(generation), *map(str, rate))
        try:
            chan.close_write()
            maps = read_maps(reader_for(peer, chan), dest, 4096)
        finally:
            chan.close()
    finally:
        peer.close()
    assert maps[unit][0] and maps[unit][1] == 32 * MiB
    return time.monotonic() - t0


def test_snaphashes_reads_at_most_the_cap_and_lets_syncs_run(xfs_mod, tmp_path):
    a, b = new_sites(xfs_mod)
    make_image(a / "images" / "v.img", 32 * MiB, [(0, os.urandom(DATA))])
    r = sync_unit(a, "v", ["v"], LocalPeer(b))
    gen = r.target_generation
    assert PoolLayout(a).snap_dir("v", gen).exists()

    (tmp_path / "free").mkdir()
    (tmp_path / "capped").mkdir()
    free = _snaphashes(a, "v", gen, tmp_path / "free")
    done: dict = {}

    def sync_meanwhile():
        # once the first map arrives: the primary has checked the generation and let the lock go
        while not (tmp_path / "capped" / "v.peer.map").exists():
            time.sleep(0.01)
        write_at(a / "images" / "v.img", 0, os.urandom(4096))
        t = time.monotonic()
        done["gen"] = sync_unit(a, "v", ["v"], LocalPeer(b)).target_generation
        done["took"], done["end"] = time.monotonic() - t, time.monotonic()
    th = threading.Thread(target=sync_meanwhile)
    th.start()
    capped = _snaphashes(a, "v", gen, tmp_path / "capped", CAP)
    read_end = time.monotonic()
    th.join()
    rate, free_rate = DATA / capped, DATA / free
    print(f"snaphashes of {DATA >> 20} MiB: uncapped {free_rate / MiB:.0f} MiB/s, capped at {CAP / MiB:.0f} MiB/s: "
          f"{rate / MiB:.1f} MiB/s ({rate / CAP:.3f}x the cap); a sync meanwhile took {done.get('took', -1):.2f}s")
    assert rate <= CAP * 1.01, rate / CAP
    assert free_rate > CAP * 1.2, "the uncapped read is faster than the cap (else the cap held nothing)"
    # the sync began after the read and ended before it: the read held no lock meanwhile
    assert done["gen"] == gen + 1 and done["end"] < read_end, done
