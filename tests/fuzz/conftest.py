"""A two-site lab for the fuzzers (replication and admin services live at site a), with
real ids to aim at and a sandbox that every fuzzed path points into."""
from __future__ import annotations

import os

import pytest

from csi_plugin.gen import csi_pb2, volumegroup_pb2
from tests.faults.conftest import build_lab, close_lab


def refresh_ids(lab) -> None:
    """Real objects to aim at, made again (by name: idempotent) since the fuzzer deletes them."""
    A = lab.clients["a"]
    vol = A.create_volume("fuzz-vol", 32 << 20).volume_id
    free = A.create_volume("fuzz-free", 16 << 20).volume_id
    grp = A.groups.CreateVolumeGroup(volumegroup_pb2.CreateVolumeGroupRequest(name="fuzz-grp")).volume_group
    member = A.create_volume("fuzz-member", 16 << 20, volumeGroup=grp.volume_group_id).volume_id
    snap = A.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(source_volume_id=vol, name="fuzz-snap")).snapshot
    A.retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    lab.ids = {"volume": [vol, free, member], "group": [grp.volume_group_id], "snapshot": [snap.snapshot_id],
               "node": [lab.sites["a"].cfg.node_id]}


@pytest.fixture(scope="module")
def fuzz_lab():
    lab = build_lab("drsvc-fuzz-")
    refresh_ids(lab)
    lab.sandbox = lab.root / "sandbox"
    lab.sandbox.mkdir()
    os.chmod(lab.sandbox, 0o700)
    try:
        yield lab
    finally:
        close_lab(lab)
