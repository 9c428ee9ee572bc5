"""The receiver fed malformed streams: truncated records, bad checksums, wrong base or
epoch, records beyond the image, oversized headers, garbage, and random mutations of a
real stream. Run as the engine runs it (a subprocess on a pool) and through the lab's
real sshd. Every bad stream is refused and the replica keeps its checksum and state."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from drsvc import runner
from drsvc.replication.wire import frames
from drsvc.replication import sync_unit
from drsvc.replication.wire.frames import CODEC_RAW, CODEC_ZERO, CODEC_ZSTD, FrameReader, ManifestChain
from drsvc.replication.common.unit_state import find_state
from drsvc.transport import Peer
from drsvc.transport.local import LocalPeer
from tests.faults.steps import peer_of
from tests.faults.tally import FUZZ_CASES
from tests.fixtures.xfs import loop_mounted_fs

MiB = 1 << 20
SIZE = 4 * MiB
BS = 64 << 10


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Recorder(Peer):
    """A LocalPeer whose channels keep every byte the sender wrote. A Peer without a
    session_key: one receiver process per request, no warm `serve` framing."""

    def __init__(self, pool):
        self.inner = LocalPeer(pool)
        self.name = "rec"
        self.sent = bytearray()

    def open(self, verb, *args):
        ch = self.inner.open(verb, *args)
        send = ch.send

        def recording(data):
            self.sent += bytes(data)
            send(data)
        ch.send = recording
        return ch

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def pools():
    """Primary a at generation 2, replica b at generation 1 (its pristine copy kept), and
    the exact bytes a real sync from 1 to 2 sends."""
    with loop_mounted_fs("4G") as mnt:
        a, b, base = mnt / "a", mnt / "b", mnt / "b-base"
        for p in (a, b):
            (p / "images").mkdir(parents=True)
        with open(a / "images" / "v.img", "wb") as f:
            f.write(os.urandom(SIZE))
        sync_unit(a, "v", ["v"], LocalPeer(b), epoch=1)
        shutil.copytree(b, base, symlinks=True)
        with open(a / "images" / "v.img", "r+b") as f:
            for off in (0, MiB, 3 * MiB):
                f.seek(off)
                f.write(os.urandom(BS))
        scratch = mnt / "scratch"
        shutil.copytree(base, scratch, symlinks=True)
        rec = Recorder(scratch)
        sync_unit(a, "v", ["v"], rec)
        yield {"a": a, "b": b, "base": base, "stream": bytes(rec.sent), "new": _sha(scratch / "images" / "v.img"),
               "old": _sha(base / "images" / "v.img"), "mnt": mnt}


def fresh_replica(pools) -> Path:
    case = pools["mnt"] / f"case-{uuid.uuid4().hex[:8]}"
    shutil.copytree(pools["base"], case, symlinks=True)
    return case


def run_receiver(pool: Path, data: bytes, verb=("apply",)) -> tuple[int, list]:
    """The receiver started as the lab's sshd starts it (``runner.module_without_site``)."""
    argv, path = runner.module_without_site("drsvc.replication.receiver", "--pool", str(pool), *verb)
    p = subprocess.run(argv, input=data, capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": path})
    return p.returncode, _frames(p.stdout)


def _frames(out: bytes) -> list:
    reader = FrameReader(io.BytesIO(out).read)
    msgs = []
    try:
        while (f := reader.next_frame(eof_ok=True)) is not None:
            if f[0] == frames.T_CONTROL:
                msgs.append(frames.parse_control(f[1]))
    except Exception:  # noqa: BLE001 - the tail of a refused conversation may be cut
        pass
    return msgs


def intact(pool: Path, pools) -> None:
    assert _sha(pool / "images" / "v.img") == pools["old"], "the replica image changed"
    st_ = find_state(pool, "v")
    assert st_.generation == 1 and st_.epoch == 1, (st_.generation, st_.epoch)


def begin(**over) -> dict:
    msg = {"type": "begin", "unit": "v", "version": frames.VERSION, "txid": uuid.uuid4().hex,
           "kind": "volume", "base": 1, "target": 2, "epoch": 1, "block_size": BS, "mode": "delta",
           "members": [{"volume_id": "v", "size": SIZE, "base_size": SIZE, "fresh": False}]}
    msg.update(over)
    return msg


def record(offset=0, data=b"\x5a" * 4096, *, member=0, codec=CODEC_RAW, length=None, checksum=None):
    length = len(data) if length is None else length
    checksum = frames.payload_checksum(data) if checksum is None else checksum
    return frames.encode_record(member, codec, offset, length, checksum, data), (member, codec == CODEC_ZERO,
                                                                                 offset, length, checksum)


def transaction(tx: dict, records, *, commit=True, manifest=None, count=None) -> bytes:
    out = frames.encode_control({"type": "status", "unit": "v"}) + frames.encode_control(tx)
    chain = ManifestChain()
    for raw, entry in records:
        out += raw
        chain.update(*entry)
    if commit:
        out += frames.encode_control({"type": "commit", "records": chain.count if count is None else count,
                                        "manifest": manifest or chain.hexdigest()})
    return out


def frame(ftype, body: bytes, length=None) -> bytes:
    return frames.frame_header(ftype, len(body) if length is None else length) + body


def _bad_cases():
    good = record(MiB)
    raw, entry = good
    return {
        "truncated record": transaction(begin(), [good], commit=False)[:-1000],
        "truncated header": transaction(begin(), [])[:-3],
        "bad checksum": transaction(begin(), [record(MiB, checksum=12345)]),
        "payload flipped": transaction(begin(), [(raw[:-1] + bytes([raw[-1] ^ 1]), entry)]),
        "wrong base": transaction(begin(base=0, target=1), [good]),
        "base ahead": transaction(begin(base=7, target=8), [good]),
        "stale epoch": transaction(begin(epoch=0), [good]),
        "target not after base": transaction(begin(target=1), [good]),
        "base size differs": transaction(begin(members=[{"volume_id": "v", "size": SIZE, "base_size": SIZE + 1,
                                                         "fresh": False}]), [good]),
        "record beyond the image": transaction(begin(), [record(SIZE - 2048)]),
        "record far beyond the image": transaction(begin(), [record(1 << 60)]),
        "zero record beyond the image": transaction(begin(), [record(SIZE, b"", codec=CODEC_ZERO, length=BS,
                                                                     checksum=0)]),
        "unknown member": transaction(begin(), [record(0, member=3)]),
        "unknown codec": transaction(begin(), [record(0, codec=9)]),
        "zstd garbage": transaction(begin(), [record(0, b"\x28\xb5\x2f\xfd" + os.urandom(64), codec=CODEC_ZSTD,
                                                     length=4096)]),
        "zstd bomb": transaction(begin(), [record(0, b"\x00" * 16, codec=CODEC_ZSTD, length=1 << 31)]),
        "manifest mismatch": transaction(begin(), [good], manifest="00" * 16),
        "record count mismatch": transaction(begin(), [good], count=7),
        "huge frame header": frames.encode_control({"type": "status", "unit": "v"})
        + frames.frame_header(frames.T_RECORD, 0xFFFFFFFF),
        "huge control frame": frame(frames.T_CONTROL, b"{}", length=frames.MAX_CONTROL + 1),
        "control too large": frame(frames.T_CONTROL, b'{"type":"status","unit":"v","x":"' + b"a" * (1 << 20) + b'"}'),
        "bad magic": b"XX" + transaction(begin(), [good])[2:],
        "unknown frame type": frame(9, b"abc"),
        "not json": frame(frames.T_CONTROL, b"{nope"),
        "json not an object": frame(frames.T_CONTROL, b"[1,2]"),
        "record before begin": raw,
        "path in unit": transaction(begin(unit="../../etc"), [good]),
        "path in volume id": transaction(begin(members=[{"volume_id": "../images/v", "size": SIZE,
                                                         "base_size": SIZE, "fresh": False}]), [good]),
        "two units": frames.encode_control({"type": "status", "unit": "v"})
        + frames.encode_control(begin(unit="w")),
        "wrong version": transaction(begin(version=99), [good]),
        "negative sizes": transaction(begin(members=[{"volume_id": "v", "size": -1, "base_size": SIZE,
                                                      "fresh": False}]), [good]),
        "no members": transaction(begin(members=[]), [good]),
        "duplicate members": transaction(begin(members=[{"volume_id": "v", "size": SIZE, "base_size": SIZE,
                                                         "fresh": False}] * 2), [good]),
        "compare not requested": transaction(begin(mode="compare", force=False), [good]),
        "garbage": os.urandom(4096),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_stream_is_refused(pools, case):
    pool = fresh_replica(pools)
    rc, msgs = run_receiver(pool, BAD[case])
    assert rc != 0, f"{case}: accepted"
    assert any(m["type"] == "error" for m in msgs), f"{case}: no error frame: {msgs}"
    assert not any(m["type"] == "committed" for m in msgs)
    intact(pool, pools)
    # the next contact (status) finds nothing committed to replay
    run_receiver(pool, b"", verb=("status", "v"))
    intact(pool, pools)
    FUZZ_CASES["receiver/malformed"] = FUZZ_CASES.get("receiver/malformed", 0) + 1


def test_recorded_stream_applies(pools):
    """The untouched recording commits generation 2: the mutations below start from a real stream."""
    pool = fresh_replica(pools)
    rc, msgs = run_receiver(pool, pools["stream"])
    assert rc == 0 and any(m["type"] == "committed" for m in msgs), msgs
    assert _sha(pool / "images" / "v.img") == pools["new"]


MUTATIONS = int(os.environ.get("RECEIVER_FUZZ_CASES", "60"))     # more for a deeper run


def mutated(stream: bytes):
    n = len(stream)
    flip = st.tuples(st.integers(0, n - 1), st.integers(1, 255)).map(
        lambda t: stream[:t[0]] + bytes([stream[t[0]] ^ t[1]]) + stream[t[0] + 1:])
    cut = st.integers(0, n - 1).map(lambda i: stream[:i])
    splice = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=64)).map(
        lambda t: stream[:t[0]] + t[1] + stream[t[0]:])
    drop = st.tuples(st.integers(0, n - 1), st.integers(1, 4096)).map(lambda t: stream[:t[0]] + stream[t[0] + t[1]:])
    return st.one_of(flip, cut, splice, drop)


def test_mutated_streams(pools):
    """Random flips, cuts, splices and drops of a real stream: refused with the replica
    intact, or (when the change hit bytes nothing depends on) committed whole."""
    outcomes = {"refused": 0, "committed": 0}

    @settings(max_examples=MUTATIONS, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=mutated(pools["stream"]))
    def run(data):
        pool = fresh_replica(pools)
        try:
            rc, msgs = run_receiver(pool, data)
            committed = [m for m in msgs if m["type"] == "committed"]
            if committed:
                assert _sha(pool / "images" / "v.img") == pools["new"], "committed something else"
                # generation 2, or a later one where the flip hit the header's target digit
                # ("target":2 -> 3): a request a sender may make (targets need only follow
                # the base), as a flip of captured_at is one; SSH's MAC guards the wire
                assert find_state(pool, "v").generation == committed[-1]["generation"] >= 2
                outcomes["committed"] += 1
            else:
                run_receiver(pool, b"", verb=("status", "v"))
                intact(pool, pools)
                outcomes["refused"] += 1
        finally:
            shutil.rmtree(pool, ignore_errors=True)
    run()
    FUZZ_CASES["receiver/mutated"] = sum(outcomes.values())
    print(f"mutated streams: {outcomes}")
    assert outcomes["refused"] > MUTATIONS // 2


SSH_CASES = ("bad checksum", "wrong base", "stale epoch", "record beyond the image", "huge frame header",
             "truncated record", "manifest mismatch", "path in unit")


def test_malformed_streams_through_sshd(fuzz_lab):
    """The same refusals from the receiver sshd's forced command runs, on a lab replica."""
    from tests.dr.helpers import generation, wait_for
    from tests.fixtures.sites import image_sha
    sa, sb = fuzz_lab.sites["a"], fuzz_lab.sites["b"]
    vol = fuzz_lab.clients["a"].create_volume("fuzz-ssh", 16 << 20).volume_id
    fuzz_lab.clients["a"].retry("EnableVolumeReplication", volume_id=vol, parameters={"schedulingInterval": "1h"})
    wait_for(lambda: generation(sb, vol) >= 1, 60, what="initial sync")
    st0 = find_state(sb.pool, vol)
    sha0 = image_sha(sb, vol)
    for name in SSH_CASES:
        data = BAD[name].replace(b'"unit":"v"', f'"unit":"{vol}"'.encode()) \
            .replace(b'"volume_id":"v"', f'"volume_id":"{vol}"'.encode())
        data = data.replace(b'"base":1', f'"base":{st0.generation}'.encode()) \
            .replace(b'"target":2', f'"target":{st0.generation + 1}'.encode())
        with peer_of(sa) as peer:
            ch = peer.open("apply")
            try:
                ch.send(data)
            except Exception:  # noqa: BLE001 - the receiver may hang up first
                pass
            ch.close_write()
            out = bytearray()
            while chunk := ch.recv(1 << 16):
                out += chunk
            rc = ch.exit_status(20)
            ch.close()
        msgs = _frames(bytes(out))
        assert rc != 0 and any(m["type"] == "error" for m in msgs), (name, rc, msgs)
        st1 = find_state(sb.pool, vol)
        assert (st1.generation, st1.epoch) == (st0.generation, st0.epoch), name
        assert image_sha(sb, vol) == sha0, name
        FUZZ_CASES["receiver/sshd"] = FUZZ_CASES.get("receiver/sshd", 0) + 1


def test_a_header_naming_a_later_target_commits_that_generation(pools):
    """The flip test_mutated_streams found (in CI): the header's "target":2 read as 3. A
    target need only follow the base (a sender whose pending generation was finalized asks
    for a later one), so the receiver commits the same bytes as generation 3, and says so."""
    stream = pools["stream"]
    assert stream.count(b'"target":2') == 1
    pool = fresh_replica(pools)
    try:
        _rc, msgs = run_receiver(pool, stream.replace(b'"target":2', b'"target":3'))
        assert [m["generation"] for m in msgs if m["type"] == "committed"] == [3]
        assert _sha(pool / "images" / "v.img") == pools["new"]
        assert find_state(pool, "v").generation == 3
    finally:
        shutil.rmtree(pool, ignore_errors=True)
