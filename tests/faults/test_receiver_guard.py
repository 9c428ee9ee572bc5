"""Under the real worker: the replica at the peer is attached read-write
(a loop device, as NodeStage leaves it). The primary's sync is refused by the receiver
with ImageInUse, the unit shows DEGRADED with that message, and the replica's bytes stay
as they were; once detached, the next sync lands and the unit is HEALTHY again."""
from __future__ import annotations

import grpc
import pytest

from drsvc.host import loop
from tests.dr.helpers import generation, wait_for, write_random
from tests.fixtures.sites import image_sha

from .steps import MiB, check_converged, status, sync_now


def _quiet_sync(client, vol):
    try:
        sync_now(client, vol, 30)
    except grpc.RpcError:
        pass


@pytest.mark.faults
def test_attached_replica_is_refused_and_reported(flab):
    A = flab.clients["a"]
    sa, sb = flab.sites["a"], flab.sites["b"]
    vol = A.create_volume("guarded", 32 * MiB).volume_id
    write_random(sa, vol, count=8, seed="guarded")
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    wait_for(lambda: generation(sb, vol) >= 1, 90, what="initial sync")
    img = sb.pool / "images" / f"{vol}.img"
    dev = loop.attach(img)
    try:
        before, gen = image_sha(sb, vol), generation(sb, vol)
        write_random(sa, vol, count=4, seed="guarded-2")
        _quiet_sync(A, vol)
        st = wait_for(lambda: (s := status(A, vol)).status == "DEGRADED" and s, 60, what="DEGRADED")
        assert "attached read-write" in st.status_message and dev in st.status_message, st.status_message
        assert image_sha(sb, vol) == before and generation(sb, vol) == gen
    finally:
        loop.detach_image(img)
    _quiet_sync(A, vol)
    wait_for(lambda: status(A, vol).status == "HEALTHY", 60, what="HEALTHY after detach")
    check_converged(sa, sb, vol, [vol])
