"""What a receiver run loads. The receiver starts once per channel (sshd's forced command),
so what it imports is paid by every sync and every status request of every unit."""
from __future__ import annotations

import os

from drsvc.replication import peer_status, sync_unit
from drsvc.transport.local import LocalPeer

MiB = 1 << 20
# stdlib modules a status run has no use for: logging loads traceback, linecache and
# tokenize behind it; typing and uuid are for annotations and repair ids; shutil for removals
NOT_FOR_A_STATUS = {"logging", "typing", "uuid", "shutil"}


def _loaded(err: str) -> set[str]:
    """Module names from ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    return {line.split("|")[2].strip() for line in err.splitlines() if line.startswith("import time:")}


def test_a_status_request_loads_only_what_it_uses(tmp_path, capfd):
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        (p / "images").mkdir(parents=True)
    with open(a / "images" / "v.img", "wb") as f:
        f.truncate(4 * MiB)
        f.write(os.urandom(MiB))
    sync_unit(a, "v", ["v"], LocalPeer(b))
    capfd.readouterr()
    peer = LocalPeer(b, env={"PYTHONPROFILEIMPORTTIME": "1"})
    st = peer_status(peer, "v")
    assert st["generation"] == 1
    peer.last_proc.wait(timeout=30)          # all of its lines written
    loaded = _loaded(capfd.readouterr().err)
    assert {"drsvc.layout", "drsvc.replication.receiver.transaction"} <= loaded      # the scan sees them
    assert not loaded & NOT_FOR_A_STATUS, sorted(loaded & NOT_FOR_A_STATUS)


def test_an_idle_generation_commits_without_numpy(tmp_path, capfd):
    """An interval with no writes still ships a generation (the peer's proof of how recent
    it is), with recovery points kept: its receiver has no ranges to keep, so it loads
    neither numpy nor zstandard. A generation that writes loads them, ahead of its commit."""
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        (p / "images").mkdir(parents=True)
    img = a / "images" / "v.img"
    with open(img, "wb") as f:
        f.truncate(4 * MiB)
        f.write(os.urandom(MiB))
    origin = {"site": "a", "interval": 60, "kind": "volume", "volumes": {}, "retention": "1x1000w(keep=all)"}
    sync_unit(a, "v", ["v"], LocalPeer(b), origin=origin)
    capfd.readouterr()
    runs = []
    for write in (False, True):
        if write:
            with open(img, "r+b") as f:
                f.seek(2 * MiB)
                f.write(os.urandom(4096))
        peer = LocalPeer(b, env={"PYTHONPROFILEIMPORTTIME": "1"})
        sync_unit(a, "v", ["v"], peer, origin=origin)
        peer.last_proc.wait(timeout=30)
        runs.append(_loaded(capfd.readouterr().err))
    assert peer_status(LocalPeer(b), "v")["generation"] == 3
    idle, wrote = runs
    assert "drsvc.replication.receiver.commit_points" in idle       # it kept its point
    assert not idle & {"numpy", "zstandard"}, sorted(idle & {"numpy", "zstandard"})
    assert "numpy" in wrote


def test_a_receiver_whose_channel_is_gone_still_exits_with_its_code(tmp_path):
    """A sender that gave up closes the channel before the receiver says why it stopped: the
    error frame and the stderr line both meet a closed pipe. The receiver still exits with the
    code of its error (2: a typed one), not with a traceback of the broken pipe."""
    import subprocess
    import sys
    (tmp_path / "images").mkdir()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    os.close(r_out)
    os.close(r_err)         # nobody reads either: every write is EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "drsvc.replication.receiver", "--pool", str(tmp_path), "no-such-verb"],
                           stdin=subprocess.DEVNULL, stdout=w_out, stderr=w_err, timeout=60)
    finally:
        os.close(w_out)
        os.close(w_err)
    assert p.returncode == 2
