"""Recovery points through the playbooks: drill.yml and unplanned-failover.yml take
`recovery_point`, run for real against the two-site lab."""
from __future__ import annotations

import hashlib
import os

from tests.ansible.test_playbooks import ansible, clients  # noqa: F401 - the fixture and its helper
from tests.dr.helpers import wait_for


def _files(a, vid, tmp_path, bodies=None) -> dict:
    """Write (or overwrite in place) files on the volume at a; their sha256 by name."""
    stg, mnt = tmp_path / "stg-a", tmp_path / "mnt-a"
    a.mount(vid, str(stg), str(mnt))
    try:
        if bodies is None:
            bodies = {f"f{i}.bin": os.urandom(200_000) for i in range(6)}
            for name, body in bodies.items():
                (mnt / name).write_bytes(body)
        else:
            for name, body in bodies.items():
                with open(mnt / name, "r+b") as f:
                    f.write(body)
        os.sync()
        return {n: hashlib.sha256((mnt / n).read_bytes()).hexdigest() for n in sorted(os.listdir(mnt))
                if n.endswith(".bin")}
    finally:
        a.unmount(vid, str(stg), str(mnt))


def test_drill_and_failover_at_a_recovery_point(lab, ansible, tmp_path):  # noqa: F811 - the fixture
    a, b = clients(lab)
    with a, b:
        vid = a.create_volume("rp-play", 64 << 20)["volume_id"]
        unit = {"volume_id": vid}
        sums = _files(a, vid, tmp_path)
        ansible.module("drsvc_replication", endpoint=lab.sites["a"].endpoint, volume_id=vid, state="enabled",
                       peer="b", interval="1h")
        wait_for(lambda: a.status(**unit)["generation"] >= 1, 60, what="the initial sync")
        point = b.recovery_points(**unit)["points"][-1]["generation"]
        _files(a, vid, tmp_path, {n: os.urandom(200_000) for n in list(sums)[:3]})     # "encrypted"
        for _ in range(2):
            ansible.module("drsvc_replication", endpoint=lab.sites["a"].endpoint, volume_id=vid, state="synced")
        common = dict(primary_site="a", secondary_site="b", volume_id=vid)
        # the latest generation fails the check; the recovery point passes it
        ansible.playbook("drill.yml", ok=False, drill_expected_sha256=sums, **common)
        out = ansible.playbook("drill.yml", "-v", drill_expected_sha256=sums, recovery_point=str(point), **common)
        assert f"generation {point} verification passed" in out, out
        # take over at the point
        ansible.playbook("unplanned-failover.yml", recovery_point=str(point), **common)
        assert b.status(**unit)["role"] == "primary"
        stg, mnt = tmp_path / "stg-b", tmp_path / "mnt-b"
        b.mount(vid, str(stg), str(mnt))
        try:
            assert {n: hashlib.sha256((mnt / n).read_bytes()).hexdigest() for n in sums} == sums
        finally:
            b.unmount(vid, str(stg), str(mnt))
