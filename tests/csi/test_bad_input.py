"""Every RPC fed bad input answers the spec's code with a message, and touches
nothing outside its pool."""
from __future__ import annotations

import os
import re
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import MiB, capability

Code = grpc.StatusCode
OK = None
PB = csi_pb2
PiB = 1 << 50
HOSTILE_IDS = ["../../etc", "..", "/etc/passwd", "a/b", "x" * 129, "vol-1\n", "", "."]
CR = PB.CapacityRange


def call(stub_method, req):
    """The status code of one RPC (None for OK), asserting errors carry a message."""
    try:
        stub_method(req, timeout=60)
    except grpc.RpcError as e:
        assert e.details(), f"{stub_method} answered {e.code()} without a message"
        return e.code()
    return OK


def snapshot_tree(root: Path, skip: Path | None = None) -> dict:
    """path -> (size, mtime) for every entry under *root* (not following links)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            try:
                s = p.lstat()
            except FileNotFoundError:
                continue
            out[str(p)] = (s.st_size if not p.is_dir() else 0, s.st_mtime_ns)
    return out


def top_level(root: Path) -> set:
    return set(os.listdir(root))


ALLOWED_POOL = re.compile(
    r"^(pool\.json|images|volumes|snapshots|names|node|locks|replication|groups|group_snapshots"
    r"|images/vol-[0-9a-f]{24}\.img|volumes/vol-[0-9a-f]{24}\.json"
    r"|snapshots/snap-[0-9a-f]{24}\.(img|json)|names/(volume|snapshot|group-snapshot)-[0-9a-f]{40}\.json"
    r"|group_snapshots/gsnap-[0-9a-f]{24}\.json"
    r"|node/vol-[0-9a-f]{24}\.json|locks/((vol|snap|gsnap)-[0-9a-f]{24}(\.mount)?|(volume|snapshot|group-snapshot)-[0-9a-f]{40})\.lock)$")


def cases(vol_id: str, snap_id: str, staged: str, staging: Path, target: Path):
    """(label, stub, method, request, expected codes) for every RPC's bad inputs."""
    ext4, block = capability("ext4"), capability("block")
    multi = capability("ext4", PB.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER)
    ntfs = capability("ntfs")
    IA, NF, OOR, AE, AB, FP = (Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.OUT_OF_RANGE,
                               Code.ALREADY_EXISTS, Code.ABORTED, Code.FAILED_PRECONDITION)
    missing = "vol-" + "0" * 24
    C, N = "controller", "node"

    def cv(**kw):
        kw.setdefault("name", "bad-input")
        kw.setdefault("volume_capabilities", [ext4])
        return PB.CreateVolumeRequest(**kw)

    def src_snap(i):
        s = PB.VolumeContentSource()
        s.snapshot.snapshot_id = i
        return s

    def src_vol(i):
        s = PB.VolumeContentSource()
        s.volume.volume_id = i
        return s

    yield "create: no name", C, "CreateVolume", cv(name=""), {IA}
    yield "create: no capabilities", C, "CreateVolume", cv(volume_capabilities=[]), {IA}
    yield "create: capability without access type", C, "CreateVolume", cv(
        volume_capabilities=[PB.VolumeCapability(access_mode=ext4.access_mode)]), {IA}
    yield "create: no access mode", C, "CreateVolume", cv(
        volume_capabilities=[PB.VolumeCapability(mount=PB.VolumeCapability.MountVolume())]), {IA}
    yield "create: multi-node mode", C, "CreateVolume", cv(volume_capabilities=[multi]), {IA}
    yield "create: unknown fs", C, "CreateVolume", cv(volume_capabilities=[ntfs]), {IA}
    yield "create: long name", C, "CreateVolume", cv(name="n" * 129), {IA}
    yield "create: control chars", C, "CreateVolume", cv(name="a\x00b"), {IA}
    yield "create: unknown parameter", C, "CreateVolume", cv(parameters={"bogus": "1"}), {IA}
    yield "create: bad preallocate", C, "CreateVolume", cv(parameters={"preallocate": "yes"}), {IA}
    yield "create: oversized parameters", C, "CreateVolume", cv(
        parameters={f"csi.storage.k8s.io/k{i}": "v" * 100 for i in range(50)}), {IA}
    yield "create: oversized secrets", C, "CreateVolume", cv(secrets={"k": "v" * 5000}), {IA}
    yield "create: negative required", C, "CreateVolume", cv(capacity_range=CR(required_bytes=-1)), {OOR, IA}
    yield "create: negative limit", C, "CreateVolume", cv(capacity_range=CR(limit_bytes=-5)), {OOR, IA}
    yield "create: required > limit", C, "CreateVolume", cv(
        capacity_range=CR(required_bytes=64 * MiB, limit_bytes=32 * MiB)), {OOR}
    yield "create: larger than pool", C, "CreateVolume", cv(capacity_range=CR(required_bytes=PiB)), {OOR}
    yield "create: xfs below its minimum limit", C, "CreateVolume", cv(
        volume_capabilities=[capability("xfs")], capacity_range=CR(limit_bytes=16 * MiB)), {OOR}
    yield "create: same name, other size", C, "CreateVolume", cv(
        name="existing", capacity_range=CR(required_bytes=256 * MiB)), {AE}
    yield "create: unreachable topology", C, "CreateVolume", cv(
        accessibility_requirements=PB.TopologyRequirement(
            requisite=[PB.Topology(segments={"topology.drsvc.io/node": "elsewhere"})])), {Code.RESOURCE_EXHAUSTED}
    yield "create: empty content source", C, "CreateVolume", cv(
        volume_content_source=PB.VolumeContentSource()), {IA}
    yield "create: missing source snapshot", C, "CreateVolume", cv(
        volume_content_source=src_snap("snap-" + "0" * 24)), {NF}
    yield "create: missing source volume", C, "CreateVolume", cv(volume_content_source=src_vol(missing)), {NF}
    yield "create: clone above limit", C, "CreateVolume", cv(
        volume_content_source=src_vol(vol_id), capacity_range=CR(limit_bytes=16 * MiB)), {OOR}
    for bad in HOSTILE_IDS:
        want = {IA, NF} if bad else {IA}
        yield f"create: source volume {bad!r}", C, "CreateVolume", cv(volume_content_source=src_vol(bad)), want
        yield f"create: source snapshot {bad!r}", C, "CreateVolume", cv(
            volume_content_source=src_snap(bad)), want
        yield f"delete: {bad!r}", C, "DeleteVolume", PB.DeleteVolumeRequest(volume_id=bad), {IA}
        yield f"validate: {bad!r}", C, "ValidateVolumeCapabilities", PB.ValidateVolumeCapabilitiesRequest(
            volume_id=bad, volume_capabilities=[ext4]), want
        yield f"get: {bad!r}", C, "ControllerGetVolume", PB.ControllerGetVolumeRequest(volume_id=bad), want
        yield f"expand: {bad!r}", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
            volume_id=bad, capacity_range=CR(required_bytes=128 * MiB)), want
        yield f"snapshot: source {bad!r}", C, "CreateSnapshot", PB.CreateSnapshotRequest(
            name="bad-snap", source_volume_id=bad), want
        yield f"delete snapshot: {bad!r}", C, "DeleteSnapshot", PB.DeleteSnapshotRequest(snapshot_id=bad), {IA}
        yield f"stage: {bad!r}", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
            volume_id=bad, staging_target_path=str(staging), volume_capability=ext4), want
        yield f"unstage: {bad!r}", N, "NodeUnstageVolume", PB.NodeUnstageVolumeRequest(
            volume_id=bad, staging_target_path=str(staging)), want
        yield f"publish: {bad!r}", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
            volume_id=bad, staging_target_path=str(staging), target_path=str(target),
            volume_capability=ext4), want
        yield f"unpublish: {bad!r}", N, "NodeUnpublishVolume", PB.NodeUnpublishVolumeRequest(
            volume_id=bad, target_path=str(target)), want
        yield f"stats: {bad!r}", N, "NodeGetVolumeStats", PB.NodeGetVolumeStatsRequest(
            volume_id=bad, volume_path=str(target)), want
        yield f"node expand: {bad!r}", N, "NodeExpandVolume", PB.NodeExpandVolumeRequest(
            volume_id=bad, volume_path=str(target)), want
        if bad:   # a name may be any string: it is hashed, never a path
            yield f"create: name {bad!r}", C, "CreateVolume", cv(name=bad), {OK, IA}
            yield f"snapshot: name {bad!r}", C, "CreateSnapshot", PB.CreateSnapshotRequest(
                name=bad, source_volume_id=vol_id), {OK, IA}

    yield "validate: no caps", C, "ValidateVolumeCapabilities", PB.ValidateVolumeCapabilitiesRequest(
        volume_id=vol_id), {IA}
    yield "validate: missing volume", C, "ValidateVolumeCapabilities", PB.ValidateVolumeCapabilitiesRequest(
        volume_id=missing, volume_capabilities=[ext4]), {NF}
    yield "get: missing volume", C, "ControllerGetVolume", PB.ControllerGetVolumeRequest(volume_id=missing), {NF}
    yield "list: bad token", C, "ListVolumes", PB.ListVolumesRequest(starting_token="zzz"), {AB}
    yield "list: token past end", C, "ListVolumes", PB.ListVolumesRequest(starting_token="1000"), {AB}
    yield "list: negative max", C, "ListVolumes", PB.ListVolumesRequest(max_entries=-1), {IA}
    yield "list snapshots: bad token", C, "ListSnapshots", PB.ListSnapshotsRequest(starting_token="-"), {AB}
    yield "expand: no capacity", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
        volume_id=vol_id), {IA}
    yield "expand: missing volume", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
        volume_id=missing, capacity_range=CR(required_bytes=128 * MiB)), {NF}
    yield "expand: shrink", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
        volume_id=vol_id, capacity_range=CR(limit_bytes=16 * MiB)), {OOR}
    yield "expand: beyond pool", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
        volume_id=vol_id, capacity_range=CR(required_bytes=PiB)), {OOR}
    yield "expand: required > limit", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
        volume_id=vol_id, capacity_range=CR(required_bytes=256 * MiB, limit_bytes=128 * MiB)), {OOR}
    yield "expand: negative", C, "ControllerExpandVolume", PB.ControllerExpandVolumeRequest(
        volume_id=vol_id, capacity_range=CR(required_bytes=-1)), {OOR, IA}
    yield "snapshot: no name", C, "CreateSnapshot", PB.CreateSnapshotRequest(source_volume_id=vol_id), {IA}
    yield "snapshot: no source", C, "CreateSnapshot", PB.CreateSnapshotRequest(name="s"), {IA}
    yield "snapshot: long name", C, "CreateSnapshot", PB.CreateSnapshotRequest(
        name="s" * 129, source_volume_id=vol_id), {IA}
    yield "snapshot: missing source", C, "CreateSnapshot", PB.CreateSnapshotRequest(
        name="s", source_volume_id=missing), {NF}
    yield "snapshot: unknown parameter", C, "CreateSnapshot", PB.CreateSnapshotRequest(
        name="s", source_volume_id=vol_id, parameters={"bogus": "1"}), {IA}
    yield "snapshot: name taken by another source", C, "CreateSnapshot", PB.CreateSnapshotRequest(
        name="existing-snap", source_volume_id=staged), {AE}
    yield "publish to controller", C, "ControllerPublishVolume", PB.ControllerPublishVolumeRequest(
        volume_id=vol_id, node_id="node-1", volume_capability=ext4), {Code.UNIMPLEMENTED}

    yield "stage: no path", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=vol_id, volume_capability=ext4), {IA}
    yield "stage: relative path", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=vol_id, staging_target_path="relative/staging", volume_capability=ext4), {IA}
    yield "stage: no capability", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=vol_id, staging_target_path=str(staging)), {IA}
    yield "stage: unknown fs", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=vol_id, staging_target_path=str(staging), volume_capability=ntfs), {IA}
    yield "stage: missing volume", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=missing, staging_target_path=str(staging), volume_capability=ext4), {NF}
    yield "stage: staged elsewhere", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=staged, staging_target_path=str(staging) + "-other", volume_capability=ext4), {AE}
    yield "stage: staged as mount, asked block", N, "NodeStageVolume", PB.NodeStageVolumeRequest(
        volume_id=staged, staging_target_path=str(staging), volume_capability=block), {AE}
    yield "unstage: no path", N, "NodeUnstageVolume", PB.NodeUnstageVolumeRequest(volume_id=vol_id), {IA}
    yield "unstage: missing volume", N, "NodeUnstageVolume", PB.NodeUnstageVolumeRequest(
        volume_id=missing, staging_target_path=str(staging)), {NF}
    yield "publish: no target", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
        volume_id=staged, staging_target_path=str(staging), volume_capability=ext4), {IA}
    yield "publish: relative target", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
        volume_id=staged, staging_target_path=str(staging), target_path="relative/target",
        volume_capability=ext4), {IA}
    yield "publish: no capability", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
        volume_id=staged, staging_target_path=str(staging), target_path=str(target)), {IA}
    yield "publish: not staged", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
        volume_id=vol_id, staging_target_path=str(staging) + "-x", target_path=str(target),
        volume_capability=ext4), {FP}
    yield "publish: missing volume", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
        volume_id=missing, staging_target_path=str(staging), target_path=str(target),
        volume_capability=ext4), {NF}
    yield "publish: wrong access type", N, "NodePublishVolume", PB.NodePublishVolumeRequest(
        volume_id=staged, staging_target_path=str(staging), target_path=str(target),
        volume_capability=block), {AE}
    yield "unpublish: no target", N, "NodeUnpublishVolume", PB.NodeUnpublishVolumeRequest(
        volume_id=vol_id), {IA}
    yield "unpublish: missing volume", N, "NodeUnpublishVolume", PB.NodeUnpublishVolumeRequest(
        volume_id=missing, target_path=str(target)), {NF}
    yield "stats: no path", N, "NodeGetVolumeStats", PB.NodeGetVolumeStatsRequest(volume_id=vol_id), {IA}
    yield "stats: path does not exist", N, "NodeGetVolumeStats", PB.NodeGetVolumeStatsRequest(
        volume_id=staged, volume_path=str(target) + "-nope"), {NF}
    yield "stats: missing volume", N, "NodeGetVolumeStats", PB.NodeGetVolumeStatsRequest(
        volume_id=missing, volume_path=str(staging)), {NF}
    yield "node expand: no path", N, "NodeExpandVolume", PB.NodeExpandVolumeRequest(volume_id=vol_id), {IA}
    yield "node expand: missing volume", N, "NodeExpandVolume", PB.NodeExpandVolumeRequest(
        volume_id=missing, volume_path=str(staging)), {NF}
    yield "node expand: above the volume", N, "NodeExpandVolume", PB.NodeExpandVolumeRequest(
        volume_id=staged, volume_path=str(staging), capacity_range=CR(required_bytes=PiB)), {OOR}


def test_bad_input_codes_and_no_side_effects(plugin, paths, tmp_path):
    vol = plugin.create("existing", 64 * MiB)
    other = plugin.create("staged", 64 * MiB)
    snap = plugin.snapshot("existing-snap", vol.volume_id)
    staging, target = paths("bad")
    plugin.stage(other.volume_id, staging)

    sentinel_parent = snapshot_tree(plugin.pool.parent, skip=plugin.pool)
    etc = snapshot_tree(Path("/etc"))
    tmp_top, root_top = top_level(Path("/tmp")), top_level(Path("/"))
    images_before = set(os.listdir(plugin.pool / "images"))

    wrong = []
    created = []
    for label, svc, method, req, want in cases(vol.volume_id, snap.snapshot_id, other.volume_id,
                                                  staging, target):
        stub = getattr(getattr(plugin, svc), method)
        got = call(stub, req)
        if got not in want:
            wrong.append(f"{label}: got {got}, want {sorted(map(str, want))}")
        if got is OK and method == "CreateVolume":
            created.append(stub(req).volume.volume_id)
    assert not wrong, "\n".join(wrong)
    assert plugin.probe()

    for vid in created:                     # hostile names made ordinary volumes
        assert re.fullmatch(r"vol-[0-9a-f]{24}", vid)
        plugin.delete(vid)
    assert snapshot_tree(plugin.pool.parent, skip=plugin.pool) == sentinel_parent
    assert snapshot_tree(Path("/etc")) == etc
    assert os.listdir(plugin.cwd) == [], "a relative path reached the plugin's cwd"
    # other engineers' tests come and go in /tmp; ours must not add path-like names
    assert not {"etc", "passwd", "a", "relative"} & (top_level(Path("/tmp")) - tmp_top)
    assert top_level(Path("/")) == root_top
    assert set(os.listdir(plugin.pool / "images")) >= images_before
    for dirpath, dirnames, filenames in os.walk(plugin.pool):
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), plugin.pool)
            assert ALLOWED_POOL.match(rel), f"unexpected file in pool: {rel!r}"
    plugin.unstage(other.volume_id, staging)


ID_FIELDS = [
    ("controller", "DeleteVolume", lambda s: PB.DeleteVolumeRequest(volume_id=s)),
    ("controller", "ControllerGetVolume", lambda s: PB.ControllerGetVolumeRequest(volume_id=s)),
    ("controller", "CreateVolume", lambda s: PB.CreateVolumeRequest(
        name=s, volume_capabilities=[capability("ext4")], capacity_range=CR(required_bytes=MiB))),
    ("controller", "CreateSnapshot", lambda s: PB.CreateSnapshotRequest(name="fuzz", source_volume_id=s)),
    ("controller", "DeleteSnapshot", lambda s: PB.DeleteSnapshotRequest(snapshot_id=s)),
    ("controller", "ListVolumes", lambda s: PB.ListVolumesRequest(starting_token=s)),
    ("node", "NodeStageVolume", lambda s: PB.NodeStageVolumeRequest(
        volume_id=s, staging_target_path="/nonexistent-drsvc/stage", volume_capability=capability("ext4"))),
    ("node", "NodeUnpublishVolume", lambda s: PB.NodeUnpublishVolumeRequest(
        volume_id=s, target_path="/nonexistent-drsvc/target")),
    ("node", "NodeGetVolumeStats", lambda s: PB.NodeGetVolumeStatsRequest(
        volume_id=s, volume_path="/nonexistent-drsvc/target")),
]
SPEC_CODES = {OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ABORTED, Code.ALREADY_EXISTS}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(ID_FIELDS),
       value=st.one_of(st.text(max_size=200),
                       st.from_regex(r"(vol|snap)-[0-9a-f]{0,30}[\n./]{0,3}", fullmatch=True),
                       st.sampled_from(HOSTILE_IDS)))
def test_random_ids_get_spec_codes(plugin, field, value):
    svc, method, build = field
    got = call(getattr(getattr(plugin, svc), method), build(value))
    assert got in SPEC_CODES, f"{method}({value!r}) -> {got}"
    if method == "CreateVolume" and got is OK:
        plugin.delete(plugin.controller.CreateVolume(build(value)).volume.volume_id)


def test_server_survives_fuzzing(plugin):
    # runs after the fuzz in file order; also a cheap standalone liveness check
    assert plugin.probe() and plugin.alive()
