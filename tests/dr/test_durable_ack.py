"""Two sites whose peers acknowledge "durable" (``ack`` in each [peers.<name>] table): the
site config reaches the workers' syncs, and a forced Promote sent the moment a sync has
answered finds the replica at that sync's generation (it waits on the unit's lock for the
apply that follows the answer)."""
from __future__ import annotations

import re

import pytest

from drsvc.replication.common.unit_state import find_state
from tests.dr.helpers import generation, write_random
from tests.faults.steps import reissue, sync_now
from tests.fixtures.sites import build_lab, close_lab, image_sha

pytestmark = pytest.mark.own_lab

INTERVAL = {"schedulingInterval": "1h"}     # the test drives every sync after the first


def _durable(text: str) -> str:
    return re.sub(r"(\[peers\.[^\]\n]+\]\n)", lambda m: m.group(1) + 'ack = "durable"\n', text)


@pytest.fixture(scope="module")
def durable_lab():
    lab = build_lab("drsvc-durable-", configure=_durable)
    try:
        yield lab
    finally:
        close_lab(lab)


def test_a_promote_right_after_a_durable_answer_finds_the_generation(durable_lab):
    lab = durable_lab
    A, B = lab.clients["a"], lab.clients["b"]
    sa, sb = lab.sites["a"], lab.sites["b"]
    vol = A.create_volume("ack", 64 << 20).volume_id
    write_random(sa, vol, count=64, seed=1)
    A.retry("EnableVolumeReplication", volume_id=vol, parameters=INTERVAL, sidecar=True)
    # the enable's first sync may still be running: SyncNow answers ABORTED until it ends
    reissue(lambda: sync_now(A, vol), what="sync")
    # thousands of scattered blocks: each one's old bytes go to the point's undo copy, after the answer
    write_random(sa, vol, count=3000, size=4096, seed=2)
    reissue(lambda: sync_now(A, vol), what="sync")
    acked = generation(sa, vol)
    B.retry("PromoteVolume", volume_id=vol, force=True, sidecar=True)
    st = find_state(sb.pool, vol)
    assert st.role == "primary" and st.generation == acked >= 2
    assert image_sha(sb, vol) == image_sha(sa, vol)
    assert "after_answer" in st.received[-1]         # the apply followed the answer
