"""csi-sanity (kubernetes-csi/csi-test) against a multi-node site: the site's controller
for Controller calls, n1's plugin for Identity and Node calls. Real parts (site_n1).

Deselected by default (marker peer_binary): csi-sanity is built outside the repo. Run with
DRSVC_CSI_SANITY=/path/to/csi-sanity pytest -m peer_binary tests/multinode/test_csi_sanity.py
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import capability, mounts_under

MiB = 1 << 20
BINARY = os.environ.get("DRSVC_CSI_SANITY", "")

pytestmark = [
    pytest.mark.peer_binary,
    pytest.mark.skipif(not BINARY, reason="DRSVC_CSI_SANITY is not set: build csi-sanity from "
                                          "kubernetes-csi/csi-test outside the repo and name the binary"),
]


def ballast(lab, node: str) -> str:
    """A preallocated volume on *node*, through the controller (placement by topology)."""
    req = csi_pb2.CreateVolumeRequest(name=f"ballast-{node}", volume_capabilities=[capability("ext4")],
                                      capacity_range=csi_pb2.CapacityRange(required_bytes=256 * MiB),
                                      parameters={"preallocate": "true"})
    req.accessibility_requirements.requisite.add(segments={"topology.drsvc.io/node": node})
    return lab.controller.CreateVolume(req, timeout=60).volume.volume_id


def test_csi_sanity_passes_against_the_controller_and_n1(site_n1):
    binary = Path(BINARY)
    assert binary.is_file() and os.access(binary, os.X_OK), f"DRSVC_CSI_SANITY={BINARY} is not an executable"
    # Some of csi-sanity's node tests create their volume with no accessibility requirement
    # and stage it on the node under test; the spec lets the site place such a volume on any
    # node (here: the one with the most free space). Take space on n2 and n3 so that n1 is it.
    kept = {ballast(site_n1, n) for n in ("n2", "n3")}
    root = site_n1.root
    out = subprocess.run(
        [str(binary), "--csi.endpoint", f"unix://{site_n1.n1.sock}",
         "--csi.controllerendpoint", site_n1.endpoint, "--csi.testvolumesize", str(64 * MiB),
         "--csi.mountdir", str(root / "sanity-mnt"), "--csi.stagingdir", str(root / "sanity-stage"),
         "-ginkgo.no-color"],
        capture_output=True, text=True, timeout=600, cwd=root)
    text = out.stdout + out.stderr
    summary = re.search(r"(\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped", text)
    assert summary, f"no csi-sanity summary (exit {out.returncode}):\n{text[-4000:]}"
    passed, failed, pending, skipped = map(int, summary.groups())
    print(f"csi-sanity: {passed} passed, {failed} failed, {pending} pending, {skipped} skipped")
    fails = "\n".join(re.findall(r"^\s*\[FAIL\].*$", text, re.M))
    assert failed == 0 and out.returncode == 0, f"{failed} failed:\n{fails}\n{text[-4000:]}"
    assert passed > 0
    # csi-sanity cleaned up after itself: through the controller, on every node
    left = {e.volume.volume_id for e in site_n1.controller.ListVolumes(csi_pb2.ListVolumesRequest(),
                                                                       timeout=60).entries}
    assert left == kept
    assert not mounts_under(root / "sanity-mnt", root / "sanity-stage")
