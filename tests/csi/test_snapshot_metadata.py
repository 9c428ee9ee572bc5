"""SnapshotMetadata (CSI 1.10): allocated and changed block ranges, streamed.

Caller: kubernetes-csi/external-snapshot-metadata's sidecar forwards a backup
tool's GetMetadataAllocated/GetMetadataDelta to the driver's socket and relays
the stream (pkg/sidecar/sidecar.go, pkg/internal/server/grpc/get_metadata_delta.go);
a broken stream is resumed with starting_offset after the last range received.

Ground truth is a byte comparison of the two snapshot images at 4 KiB: no
changed block may be missing, and at most 5% more blocks may be reported.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import grpc
import pytest

from csi_plugin.gen import csi_pb2, csi_pb2_grpc
from tests.fixtures.csi import MiB

Code = grpc.StatusCode
BS = 4096
SIZE = 64 * MiB


def source_snapshot(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    src = csi_pb2.VolumeContentSource()
    src.snapshot.snapshot_id = snapshot_id
    return src


def stream(plugin, method: str, max_results: int = 0, starting_offset: int = 0, **ids):
    """All messages of one call, with the stream's invariants checked."""
    stub = csi_pb2_grpc.SnapshotMetadataStub(plugin.channel)
    req_cls = getattr(csi_pb2, f"{method}Request")
    msgs = list(getattr(stub, method)(req_cls(max_results=max_results, starting_offset=starting_offset,
                                              **ids), timeout=120))
    assert msgs, "every stream carries at least the type and capacity"
    kinds = {m.block_metadata_type for m in msgs}
    caps = {m.volume_capacity_bytes for m in msgs}
    assert len(kinds) == 1 and len(caps) == 1
    kind = kinds.pop()
    ranges = [(b.byte_offset, b.size_bytes) for m in msgs for b in m.block_metadata]
    for m in msgs:
        assert not max_results or len(m.block_metadata) <= max_results
    for (o1, n1), (o2, _) in zip(ranges, ranges[1:], strict=False):
        assert o1 + n1 <= o2, "ascending, no overlap, across messages too"
    assert all(n > 0 for _, n in ranges)
    if ranges:
        assert starting_offset < ranges[0][0] + ranges[0][1]
    if kind == csi_pb2.FIXED_LENGTH:
        assert len({n for _, n in ranges}) <= 1
    return kind, caps.pop(), ranges


def blocks_of(ranges) -> set[int]:
    out = set()
    for o, n in ranges:
        out.update(range(o // BS, -(-(o + n) // BS)))
    return out


def image(plugin, snapshot_id: str) -> Path:
    return plugin.pool / "snapshots" / f"{snapshot_id}.img"


def changed_blocks(a: Path, b: Path) -> set[int]:
    """The byte comparison: blocks of b that differ from a (a missing tail reads as zeros)."""
    out = set()
    with open(a, "rb") as fa, open(b, "rb") as fb:
        size = os.fstat(fb.fileno()).st_size
        for off in range(0, size, 1 << 20):
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            x += bytes(len(y) - len(x))
            if x == y:
                continue
            for i in range(0, len(y), BS):
                if x[i:i + BS] != y[i:i + BS]:
                    out.add((off + i) // BS)
    return out


def nonzero_blocks(a: Path) -> set[int]:
    out = set()
    zero = bytes(BS)
    with open(a, "rb") as f:
        off = 0
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                out.update((off + i) // BS for i in range(0, len(chunk), BS) if chunk[i:i + BS] != zero)
            off += len(chunk)
    return out


def check_delta(plugin, base: str, target: str) -> set[int]:
    kind, cap, ranges = stream(plugin, "GetMetadataDelta", base_snapshot_id=base, target_snapshot_id=target)
    assert cap == os.stat(image(plugin, target)).st_size
    got, truth = blocks_of(ranges), changed_blocks(image(plugin, base), image(plugin, target))
    assert truth, "the scenario changed something"
    assert not truth - got, f"{len(truth - got)} changed blocks missing"
    assert len(got) <= 1.05 * len(truth), f"over-reported: {len(got)} for {len(truth)}"
    return got


def check_allocated(plugin, snap: str) -> None:
    _, _, ranges = stream(plugin, "GetMetadataAllocated", snapshot_id=snap)
    got, truth = blocks_of(ranges), nonzero_blocks(image(plugin, snap))
    assert not truth - got, f"{len(truth - got)} data blocks missing"
    assert len(got) <= 1.05 * len(truth), f"over-reported: {len(got)} for {len(truth)}"


def write_at(path: Path, offset: int, data: bytes, *, create: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | (os.O_CREAT if create else 0), 0o600)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.fixture(params=["variable", "fixed"])
def md_plugin(request, make_plugin):
    p = make_plugin("--block-metadata", request.param)
    p.style = request.param
    return p


def test_advertised(plugin):
    caps = plugin.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities
    assert csi_pb2.PluginCapability.Service.SNAPSHOT_METADATA_SERVICE in {c.service.type for c in caps}


def test_mounted_filesystem(md_plugin, paths):
    """Sparse, zero-filled and rewritten regions, written through ext4."""
    p, rnd = md_plugin, random.Random(1)
    vol = p.create("md-fs", SIZE).volume_id
    staging, target = paths("fs")
    p.stage(vol, staging)
    p.publish(vol, staging, target)
    write_at(target / "data", 0, rnd.randbytes(8 * MiB), create=True)
    write_at(target / "sparse", 20 * MiB, rnd.randbytes(64 * 1024), create=True)
    write_at(target / "zeros", 0, bytes(2 * MiB), create=True)
    a = p.snapshot("md-fs-a", vol).snapshot_id
    same = (target / "data").read_bytes()[MiB:2 * MiB]
    write_at(target / "data", MiB, same)                         # rewritten with the same bytes
    write_at(target / "data", 3 * MiB, rnd.randbytes(MiB))      # rewritten
    write_at(target / "data", 5 * MiB, bytes(512 * 1024))       # zero-filled over data
    write_at(target / "zeros", 0, bytes(2 * MiB))               # zeros over zeros
    write_at(target / "sparse", 40 * MiB, rnd.randbytes(8192))  # new data in a sparse file
    (target / "gone").write_bytes(rnd.randbytes(300 * 1024))
    os.sync()
    b = p.snapshot("md-fs-b", vol).snapshot_id
    kind, _, _ = stream(p, "GetMetadataDelta", base_snapshot_id=a, target_snapshot_id=b)
    assert kind == (csi_pb2.FIXED_LENGTH if p.style == "fixed" else csi_pb2.VARIABLE_LENGTH)
    check_delta(p, a, b)
    check_allocated(p, a)
    check_allocated(p, b)
    p.unpublish(vol, target)
    p.unstage(vol, staging)


def _block_scenario(p, vol, paths, tag, rnd):
    staging, target = paths(tag)
    p.stage(vol, staging, "block")
    p.publish(vol, staging, target, "block")
    write_at(target, 0, rnd.randbytes(4 * MiB))
    write_at(target, 16 * MiB, rnd.randbytes(MiB))
    write_at(target, 30 * MiB, bytes(MiB))                      # zero-filled (allocated, reads zero)
    a = p.snapshot(f"{tag}-a", vol).snapshot_id
    with open(target, "rb") as f:
        f.seek(MiB)
        same = f.read(MiB)
    write_at(target, MiB, same)                                 # same bytes rewritten
    write_at(target, 2 * MiB + 5 * BS, rnd.randbytes(3 * BS))   # small rewrite
    write_at(target, 16 * MiB, bytes(256 * 1024))               # zeros over data
    write_at(target, 40 * MiB + 7 * BS, rnd.randbytes(BS))      # new data in a hole
    write_at(target, 30 * MiB, bytes(MiB))                      # zeros over zeros
    b = p.snapshot(f"{tag}-b", vol).snapshot_id
    p.unpublish(vol, target)
    p.unstage(vol, staging)
    return a, b


def test_block_device(md_plugin, paths):
    p, rnd = md_plugin, random.Random(2)
    vol = p.create("md-blk", SIZE, kind="block").volume_id
    a, b = _block_scenario(p, vol, paths, "blk", rnd)
    got = check_delta(p, a, b)
    assert (2 * MiB + 5 * BS) // BS in got and (40 * MiB + 7 * BS) // BS in got
    assert not {b_ for b_ in got if MiB // BS <= b_ < 2 * MiB // BS}, "same-bytes rewrite is not a change"
    check_allocated(p, a)
    check_allocated(p, b)


def test_restored_and_cloned_volumes(plugin, paths):
    """Images that share extents with another volume's snapshot (restore, clone)."""
    rnd = random.Random(3)
    origin = plugin.create("md-origin", SIZE, kind="block").volume_id
    a, _ = _block_scenario(plugin, origin, paths, "orig", rnd)
    restored = plugin.create("md-restored", SIZE, kind="block", source=source_snapshot(a)).volume_id
    c, d = _block_scenario(plugin, restored, paths, "rest", rnd)
    check_delta(plugin, c, d)
    check_allocated(plugin, c)
    src = csi_pb2.VolumeContentSource()
    src.volume.volume_id = restored
    clone = plugin.create("md-clone", SIZE, kind="block", source=src).volume_id
    e, f = _block_scenario(plugin, clone, paths, "clone", rnd)
    check_delta(plugin, e, f)
    check_allocated(plugin, f)


def test_starting_offset_and_max_results(md_plugin, paths):
    p, rnd = md_plugin, random.Random(4)
    vol = p.create("md-page", SIZE, kind="block").volume_id
    a, b = _block_scenario(p, vol, paths, "page", rnd)
    ids = {"base_snapshot_id": a, "target_snapshot_id": b}
    _, _, full = stream(p, "GetMetadataDelta", **ids)
    _, _, paged = stream(p, "GetMetadataDelta", max_results=3, **ids)
    assert blocks_of(paged) == blocks_of(full)
    # resume in the middle of a range, as a client does after a broken stream
    mid = full[len(full) // 2]
    resume_at = mid[0] + mid[1] // 2 + 1
    _, _, rest = stream(p, "GetMetadataDelta", max_results=2, starting_offset=resume_at, **ids)
    want = {blk for blk in blocks_of(full) if (blk + 1) * BS > resume_at}
    assert blocks_of(rest) == want
    _, _, alloc = stream(p, "GetMetadataAllocated", max_results=1, starting_offset=SIZE, snapshot_id=b)
    assert alloc == []


def code_of(call):
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.details(), "every error carries a human message"
    return exc.value.code()


def test_error_table(plugin):
    v1 = plugin.create("md-e1", 32 * MiB).volume_id
    v2 = plugin.create("md-e2", 32 * MiB).volume_id
    s1, s1b = plugin.snapshot("md-e1a", v1).snapshot_id, plugin.snapshot("md-e1b", v1).snapshot_id
    s2 = plugin.snapshot("md-e2a", v2).snapshot_id
    missing = "snap-" + "0" * 24

    def alloc(**kw):
        return stream(plugin, "GetMetadataAllocated", **kw)

    def delta(**kw):
        return stream(plugin, "GetMetadataDelta", **kw)

    IA, NF, OOR = Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.OUT_OF_RANGE
    assert code_of(lambda: alloc()) == IA
    assert code_of(lambda: alloc(snapshot_id="../x")) == IA
    assert code_of(lambda: alloc(snapshot_id=missing)) == NF
    assert code_of(lambda: alloc(snapshot_id=s1, starting_offset=-1)) == OOR
    assert code_of(lambda: alloc(snapshot_id=s1, starting_offset=32 * MiB + 1)) == OOR
    assert code_of(lambda: alloc(snapshot_id=s1, max_results=-1)) == IA
    assert code_of(lambda: delta(base_snapshot_id=s1)) == IA
    assert code_of(lambda: delta(base_snapshot_id=s1, target_snapshot_id=missing)) == NF
    assert code_of(lambda: delta(base_snapshot_id=s1, target_snapshot_id=s2)) == IA
    assert code_of(lambda: delta(base_snapshot_id=s1b, target_snapshot_id=s1)) == IA
    assert code_of(lambda: delta(base_snapshot_id=s1, target_snapshot_id=s1b, starting_offset=-5)) == OOR
    # unchanged: one message, no ranges
    _, cap, ranges = delta(base_snapshot_id=s1, target_snapshot_id=s1b)
    assert cap == 32 * MiB and ranges == []
