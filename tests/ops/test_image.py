"""deploy/Containerfile builds here and the image runs drsvc: scripts/build-image.sh
makes a Debian bookworm base with mmdebstrap, builds with `podman build --isolation chroot`, and
smoke-tests the image by `podman image mount` + chroot (`podman run` fails in this sandbox).

Off by default (it needs Debian's packages and PyPI, and a minute or more):
    python3 -m pytest -m image tests/ops/test_image.py -s
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.image
def test_the_image_builds_and_runs_drsvc():
    if os.geteuid() != 0:
        pytest.skip("needs root (podman image mount, chroot)")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), "--tag", "localhost/drsvc:test"],
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "drsvc 0.1.0" in p.stdout            # `drsvc --version` inside the image
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"image {doc['image']}: base {doc['base_s']}s, build {doc['build_s']}s, smoke test {doc['smoke_s']}s, "
          f"{doc['size_bytes'] / 1e6:.0f} MB")
    assert doc["ok"] is True and doc["size_bytes"] > 0
