"""Shared steps for the two-site DR tests."""
from __future__ import annotations

import os
import random

import grpc

from drsvc.layout import PoolLayout
from drsvc.replication.control.relationship import find_control
from drsvc.replication.common.unit_state import find_state
from drsvc.replication.receiver import wait_for_apply
from drsvc_lab import wait_until
from tests.fixtures.sites import image_sha


def write_random(site, volume_id, *, count=16, size=64 << 10, seed=None) -> int:
    """Scattered writes straight into the image, as the loop device would do them."""
    rnd = random.Random(seed)
    path = site.pool / "images" / f"{volume_id}.img"
    cap = os.stat(path).st_size
    with open(path, "r+b") as f:
        for _ in range(count):
            f.seek(rnd.randrange(0, cap - size, 4096))
            f.write(rnd.randbytes(size))
        f.flush()
        os.fsync(f.fileno())
    return count * size


def generation(site, unit_id) -> int:
    """The unit's generation at *site* as a reader there sees it: a peer acking at its commit
    marker records the generation once applied, after its answer."""
    wait_for_apply(PoolLayout(site.pool), unit_id)
    st = find_state(site.pool, unit_id)
    return st.generation if st else 0


def wait_for(pred, timeout=60, interval=0.3, what="condition"):
    """drsvc_lab.wait_until: pred's first truthy value, or a failure naming *what*."""
    return wait_until(pred, timeout, what, interval=interval)


def resync_ready(client, unit_id: str, gid: str | None = None) -> bool:
    """One ResyncVolume (force) of a volume, or of the group *gid* through its sidecar call."""
    key = {"group_id": unit_id} if unit_id == gid else {"volume_id": unit_id}
    return client.call("ResyncVolume", force=True, sidecar=unit_id == gid, **key).ready


def wait_each_ready(ready, units, timeout: float, what: str, *, on_timeout=None) -> None:
    """Until ``ready(unit)`` has answered true once for every unit: a unit found ready is
    done and not asked again, as the csi-addons controller reconciles each
    VolumeReplication on its own until its ResyncVolume answers ready (kubernetes-csi-addons
    internal/controller/replication.storage/volumereplication_controller.go). On a timeout,
    *on_timeout* gets the units still pending (to print what they wait on)."""
    pending = set(units)

    def all_ready() -> bool:
        pending.difference_update([u for u in sorted(pending) if ready(u)])
        return not pending
    try:
        wait_for(all_ready, timeout, what=what)
    except AssertionError as e:
        if on_timeout is not None:
            on_timeout(sorted(pending))
        raise AssertionError(f"{e}; not ready: {', '.join(sorted(pending))}") from e


def sync_attempts(site, unit_id) -> int:
    """The unit's syncs from *site* that have ended, landed or failed."""
    c = find_control(site.pool, unit_id)
    return c.syncs_total + c.failures_total if c else 0


def wait_attempts(site, unit_id, n: int, timeout: float = 60) -> None:
    """Until *n* more syncs of the unit from *site* have ended (its schedule went round n times)."""
    start = sync_attempts(site, unit_id)
    wait_for(lambda: sync_attempts(site, unit_id) >= start + n, timeout, interval=0.1,
             what=f"{n} more sync attempts of {unit_id} from {site.name}")


def wait_synced_after(lab, unit_id, volume_ids, *, src="a", dst="b", timeout=60):
    """Wait until a sync that started after now has landed, then compare images."""
    start_gen = generation(lab.sites[src], unit_id)
    wait_for(lambda: generation(lab.sites[src], unit_id) >= start_gen + 2, timeout,
             what=f"two more syncs of {unit_id} from {src}")
    for vid in volume_ids:
        assert image_sha(lab.sites[src], vid) == image_sha(lab.sites[dst], vid), vid


def last_report(site, unit_id) -> dict:
    return find_state(site.pool, unit_id).reports[-1]


def code_of(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def journaled(pool, unit_id) -> int:
    """Payload bytes a receiver has written into *unit_id*'s open transaction: into its
    data.bin, or into the staging image of a member it holds no base for (an initial sync)."""
    d = PoolLayout(pool).journal_dir(unit_id)
    total = 0
    for f in [d / "data.bin", *(d / "staging").glob("*.img")]:
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        total += st.st_size if f.name == "data.bin" else st.st_blocks * 512
    return total
