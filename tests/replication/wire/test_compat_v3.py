"""Upgrades one site at a time: this release (protocol 4) and the last release
that spoke only protocol 3, side by side, in both directions, over real sshds.

The older release is taken from git history (``git archive V3_COMMIT``) into a directory of
its own; its receiver runs as the forced command of one site's sshd with PYTHONPATH set to
that directory, and its sender and its promote run as `python -c` with the same PYTHONPATH.
A sync and a planned failover (Demote with its final sync, then Promote at the peer) go
from the new release to the old and back. With the old peer the new sender speaks 3: no
stripes, no one flight, v3's conversation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drsvc.replication.common import unit_state
from drsvc.replication import sync_unit
from drsvc.replication.common.unit_state import get_state
from drsvc.replication.control.takeover import seed_base
from drsvc.transport import LinkHints
from tests.fixtures.sshd import sshd_site

from ..conftest import make_image, new_sites, sha, write_at

V3_COMMIT = "463985f"        # main before protocol 4: SUPPORTED_VERSIONS = (3,)
ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20


@pytest.fixture(scope="module")
def v3_tree(tmp_path_factory):
    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{V3_COMMIT}^{{commit}}"],
                          capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"commit {V3_COMMIT} (the last protocol-3 release) is not in this clone's history")
    d = tmp_path_factory.mktemp("v3")
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", V3_COMMIT], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=tar, check=True)
    out = _old(d, "from drsvc.replication import protocol; print(json.dumps(protocol.SUPPORTED_VERSIONS))")
    assert out == [3], f"{V3_COMMIT} is not a protocol-3 release: {out}"
    return d


def _old(tree: Path, code: str):
    """Run *code* under the old release; it prints one JSON document."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", "import json\n" + code], env=env, capture_output=True,
                       text=True, timeout=120, cwd=str(tree))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _old_sync(tree: Path, pool: Path, site, demote: bool = False) -> dict:
    return _old(tree, f"""
from drsvc.replication import sync_unit
from drsvc.transport.ssh import SshPeer
p = SshPeer("127.0.0.1", port={site.port}, key_file={str(site.client_key)!r}, known_hosts={str(site.known_hosts)!r})
r = sync_unit({str(pool)!r}, "v", ["v"], p, demote={demote})
print(json.dumps(r.to_dict()))""")


def _old_promote(tree: Path, pool: Path) -> dict:
    """Promote as the old release's control job does (the received images become the base)."""
    return _old(tree, f"""
from drsvc.replication import state
from drsvc.replication.takeover import seed_base
seed_base({str(pool)!r}, "v")
st = state.promote({str(pool)!r}, "v")
print(json.dumps({{"role": st.role, "epoch": st.epoch}}))""")


def test_a_v3_peer_syncs_and_fails_over_both_ways(xfs_mod, v3_tree):
    a, b = new_sites(xfs_mod)
    img_a, img_b = a / "images" / "v.img", b / "images" / "v.img"
    make_image(img_a, 32 * MiB, [(0, os.urandom(8 * MiB))])
    with sshd_site(b, receiver_env={"PYTHONPATH": str(v3_tree)}) as sb, sshd_site(a) as sa:
        # new sender -> old receiver: protocol 3, one channel even when stripes are asked for
        r = sync_unit(a, "v", ["v"], sb.peer(), link=LinkHints(stripes=4))
        assert r.stripes == 1 and sha(img_a) == sha(img_b)
        write_at(img_a, 3 * MiB, os.urandom(MiB))
        r = sync_unit(a, "v", ["v"], sb.peer(), link=LinkHints(stripes=4))
        assert (r.steps, r.stripes) == (["sync"], 1) and r.round_trips >= 3   # status, ready, committed
        assert sha(img_a) == sha(img_b)
        # planned failover a -> b: the new release demotes with a final sync, the old promotes
        write_at(img_a, 9 * MiB, os.urandom(MiB))
        sync_unit(a, "v", ["v"], sb.peer(), demote=True)
        assert get_state(a, "v").role == "secondary" and sha(img_a) == sha(img_b)
        assert get_state(b, "v").peer_demoted_at == get_state(b, "v").generation
        assert _old_promote(v3_tree, b)["role"] == "primary"
        # old sender -> new receiver, then the planned failover back
        write_at(img_b, 5 * MiB, os.urandom(2 * MiB))
        back = _old_sync(v3_tree, b, sa)
        assert back["steps"] == ["sync"] and sha(img_a) == sha(img_b)
        write_at(img_b, 12 * MiB, os.urandom(MiB))
        _old_sync(v3_tree, b, sa, demote=True)
        assert get_state(b, "v").role == "secondary" and sha(img_a) == sha(img_b)
        seed_base(a, "v")
        assert unit_state.promote(a, "v").role == "primary"
        write_at(img_a, 20 * MiB, os.urandom(MiB))
        r = sync_unit(a, "v", ["v"], sb.peer())
        assert r.steps == ["sync"] and sha(img_a) == sha(img_b)
