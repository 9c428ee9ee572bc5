"""Every method of every service on the plugin socket, fed requests generated from its
proto descriptor: random, oversized and invalid fields. Only spec'd codes come back
(never INTERNAL or UNKNOWN for bad input), the server never dies, and nothing outside
the pool changes; the path sandbox gains only what NodeStage/Publish create."""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from csi_plugin.gen import admin_pb2, csi_pb2, identity_pb2, replication_pb2, volumegroup_pb2

from tests.faults.tally import FUZZ_CASES

from .conftest import refresh_ids
from .messages import Requests, message_class

C = grpc.StatusCode
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.ALREADY_EXISTS, C.FAILED_PRECONDITION,
           C.OUT_OF_RANGE, C.ABORTED, C.RESOURCE_EXHAUSTED, C.UNAUTHENTICATED, C.UNIMPLEMENTED}
MODULES = (csi_pb2, identity_pb2, volumegroup_pb2, replication_pb2, admin_pb2)
METHODS = [(svc.full_name, m) for mod in MODULES for svc in mod.DESCRIPTOR.services_by_name.values()
           for m in svc.methods]
CASES = int(os.environ.get("FUZZ_CASES", "100"))     # FUZZ_CASES=1000 for a deeper run


def _walk(root: Path, skip_mounts=True) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if skip_mounts:
            dirnames[:] = [d for d in dirnames if not os.path.ismount(os.path.join(dirpath, d))]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                s = os.lstat(p)
            except FileNotFoundError:
                continue
            out[p] = (0 if os.path.isdir(p) else s.st_size, s.st_mtime_ns)
    return out


def outside_state(lab) -> dict:
    """What must not change: /etc, the names at /, the pool's parent (minus the pool
    and the run dir's logs), and the plugin's working directory."""
    sa = lab.sites["a"]
    parent = sa.pool.parent
    plugin_cwd = Path(os.readlink(f"/proc/{sa.run.pid('plugin')}/cwd"))
    return {"etc": _walk(Path("/etc")), "root": sorted(os.listdir("/")),
            "parent": sorted(os.listdir(parent)),
            "run": sorted(n for n in os.listdir(sa.run.run_dir)),
            "cwd": sorted(os.listdir(plugin_cwd))}


def _call(channel, service, method, req):
    # server-streaming methods (SnapshotMetadata) are read to the end of the stream
    factory = channel.unary_stream if method.server_streaming else channel.unary_unary
    rpc = factory(f"/{service}/{method.name}",
                  request_serializer=lambda m: m.SerializeToString(),
                  response_deserializer=message_class(method.output_type).FromString)
    try:
        reply = rpc(req, timeout=40)
        if method.server_streaming:
            for _ in reply:
                pass
        return C.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def probe(channel):
    code, msg = _call(channel, "csi.v1.Identity", csi_pb2.DESCRIPTOR.services_by_name["Identity"]
                      .methods_by_name["Probe"], csi_pb2.ProbeRequest())
    assert code == C.OK, f"the plugin does not answer Probe after fuzzing: {code} {msg}"


@pytest.fixture(scope="module")
def fuzz_state(fuzz_lab):
    before = outside_state(fuzz_lab)
    used_paths: set = set()
    yield fuzz_lab, used_paths
    after = outside_state(fuzz_lab)
    for key in before:
        assert before[key] == after[key], f"fuzzing changed {key}: " + str(
            set(map(str, after[key])) ^ set(map(str, before[key])))
    # the sandbox holds only targets some request named (and their parents)
    allowed = set()
    for p in used_paths:
        q = Path(p)
        while q != fuzz_lab.sandbox and fuzz_lab.sandbox in q.parents:
            allowed.add(str(q))
            q = q.parent
    extra = [p for p in _walk(fuzz_lab.sandbox) if p not in allowed]
    assert not extra, f"the sandbox gained paths no request named: {extra[:5]}"


def _paths_in(msg, out: set):
    for f, v in msg.ListFields():
        if f.type == f.TYPE_STRING and f.name.endswith("path"):
            out.update(v if f.is_repeated else [v])
        elif f.type == f.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            for m in (v if f.is_repeated else [v]):
                _paths_in(m, out)


def fuzz_method(fuzz_state, service, method, cases):
    lab, used_paths = fuzz_state
    refresh_ids(lab)
    channel = lab.clients["a"].channel
    reqs = Requests(lab.ids, lab.sandbox)
    strategy = reqs.message(method.input_type)
    codes = Counter()

    @settings(max_examples=cases, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(req=strategy)
    def run(req):
        _paths_in(req, used_paths)
        code, details = _call(channel, service, method, req)
        codes[code.name] += 1
        assert code in ALLOWED, f"{service}/{method.name} answered {code.name}: {details}"
        if code != C.OK:
            assert details, f"{service}/{method.name} answered {code.name} without a message"

    t0 = time.monotonic()
    run()
    probe(channel)
    assert lab.sites["a"].run.pid("plugin") is not None, "the plugin died"
    FUZZ_CASES[f"{service}/{method.name}"] = sum(codes.values())
    print(f"{service}/{method.name}: {sum(codes.values())} cases in {time.monotonic() - t0:.1f}s {dict(codes)}")


@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s}/{m.name}" for s, m in METHODS])
def test_fuzz_method(fuzz_state, service, method):
    fuzz_method(fuzz_state, service, method, CASES)


@pytest.mark.soak
@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s}/{m.name}" for s, m in METHODS])
def test_soak_fuzz_method(fuzz_state, service, method):
    fuzz_method(fuzz_state, service, method, CASES * 10)


