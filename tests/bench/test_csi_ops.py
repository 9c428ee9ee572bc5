"""Smoke tests of bench.csi_ops with tiny sizes: what it reports, never how fast.

Without a hostpath binary the peer is reported as not measured (no figure made
up); with one (DRSVC_HOSTPATH_BIN, built outside the repo) both drivers get
figures and ratios. fill() writes what it is asked, not 1 GiB.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bench import csi_ops
from bench.csi_ops import MiB, Bench

pytestmark = pytest.mark.bench
KEYS = {"create_p50_ms", "create_p99_ms", "delete_p50_ms", "delete_p99_ms"}


def run(capsys, *argv) -> tuple[list[str], dict]:
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        pytest.skip("needs root and mkfs.xfs")
    assert csi_ops.main(["--cases", "create", "--volumes", "4", "--warmup", "1", *argv, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_without_hostpath_the_peer_is_not_measured(capsys):
    lines, result = run(capsys, "--runs", "2")
    cd = result["create_delete"]
    assert set(cd["drivers"]) == {"drsvc"} and cd["hostpath_measured"] is False and cd["ratio"] is None
    assert set(cd["drivers"]["drsvc"]) == KEYS and all(cd["drivers"]["drsvc"][k] > 0 for k in KEYS)
    assert len(cd["runs"]) == 2 and all(r["ratio"] is None for r in cd["runs"])
    assert any("not measured" in line for line in lines)


@pytest.mark.peer_binary
def test_with_hostpath_both_are_measured_side_by_side(capsys):
    """Deselected by default (marker peer_binary): the hostpath driver is built outside the repo.
    Run with DRSVC_HOSTPATH_BIN=/path/to/hostpathplugin pytest -m peer_binary tests/bench."""
    assert os.environ.get("DRSVC_HOSTPATH_BIN"), "set DRSVC_HOSTPATH_BIN to a hostpathplugin binary"
    _, result = run(capsys, "--hostpath", os.environ["DRSVC_HOSTPATH_BIN"])
    cd = result["create_delete"]
    assert set(cd["drivers"]) == {"drsvc", "hostpath"} and cd["hostpath_measured"] is True
    assert all(cd["drivers"]["hostpath"][k] > 0 for k in KEYS)
    assert cd["ratio"]["create_p50_ms"] == round(cd["create_p50_ms"] / cd["drivers"]["hostpath"]["create_p50_ms"], 2)


def test_fill_writes_what_it_is_asked():
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        pytest.skip("needs root and mkfs.xfs")
    b = Bench(Path(tempfile.mkdtemp(prefix="drsvc-test-csiops-")))
    try:
        b.setup()
        vid = b.create("small", 64 * MiB)
        assert b.fill(vid, data_seed=1, scattered=3, data_bytes=8 * MiB) == 11 * MiB
        image = b.pool / "images" / f"{vid}.img"
        allocated = image.stat().st_blocks * 512
        assert 11 * MiB <= allocated < 32 * MiB, allocated      # the head and 3 MiB, not the whole volume
        with open(image, "rb") as f:
            head = f.read(8 * MiB)
            assert head.count(0) < len(head) // 100              # random data
            f.seek(8 * MiB)
            rest = f.read()
        assert len(rest) - rest.count(0) >= 3 * MiB - 3 * 4096   # three scattered MiB after the head
        b.delete(vid)
    finally:
        b.teardown()
