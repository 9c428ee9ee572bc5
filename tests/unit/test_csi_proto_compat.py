"""protos/csi.proto (CSI v1.12.0) is a wire-compatible superset of the seed's CSI v1.

Both files are parsed by protoc into descriptors; every message, field (name,
number, type, label, type name), enum value and RPC of the seed must appear
unchanged in the new proto.
"""
from __future__ import annotations

from pathlib import Path

import grpc_tools
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT.parent.parent / "shared" / "seeds" / "000_6426b690f320535e.txt"
if not SEED.exists():                      # worktrees live at /work/wt/NAME, main at /work/main
    SEED = Path("/work/shared/seeds/000_6426b690f320535e.txt")


def _parse(proto_text: str, tmp: Path) -> descriptor_pb2.FileDescriptorProto:
    src = tmp / "csi.proto"
    src.write_text(proto_text)
    out = tmp / "set.pb"
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    assert protoc.main(["protoc", f"-I{tmp}", f"-I{include}", f"--descriptor_set_out={out}",
                        str(src)]) == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return next(f for f in fds.file if f.name == "csi.proto")


def _seed_text() -> str:
    text = SEED.read_text()
    # the seed carries a short header (origin, date, size) before the proto itself
    return text[text.index('syntax = "proto3";'):]


def _messages(fd) -> dict[str, descriptor_pb2.DescriptorProto]:
    out = {}

    def walk(prefix, msgs):
        for m in msgs:
            name = f"{prefix}.{m.name}"
            out[name] = m
            walk(name, m.nested_type)
    walk("", fd.message_type)
    return out


def _enums(fd) -> dict[str, dict[str, int]]:
    out = {"." + e.name: {v.name: v.number for v in e.value} for e in fd.enum_type}
    for name, m in _messages(fd).items():
        for e in m.enum_type:
            out[f"{name}.{e.name}"] = {v.name: v.number for v in e.value}
    return out


def _field_key(f):
    return (f.name, f.number, f.type, f.label, f.type_name, f.HasField("oneof_index"))


def test_new_proto_is_csi_v1_12(tmp_path):
    new = _parse((ROOT / "protos" / "csi.proto").read_text(), tmp_path)
    assert new.package == "csi.v1"
    services = {s.name: {m.name for m in s.method} for s in new.service}
    assert "GetSnapshot" in services["Controller"]
    assert "ControllerModifyVolume" in services["Controller"]
    assert {"CreateVolumeGroupSnapshot", "GetVolumeGroupSnapshot",
            "DeleteVolumeGroupSnapshot"} <= services["GroupController"]
    assert services["SnapshotMetadata"] == {"GetMetadataAllocated", "GetMetadataDelta"}


def test_every_seed_message_and_field_is_unchanged(tmp_path):
    (tmp_path / "seed").mkdir()
    (tmp_path / "new").mkdir()
    seed = _parse(_seed_text(), tmp_path / "seed")
    new = _parse((ROOT / "protos" / "csi.proto").read_text(), tmp_path / "new")
    assert seed.package == new.package
    seed_msgs, new_msgs = _messages(seed), _messages(new)
    assert len(seed_msgs) > 100          # the parse really saw the seed
    for name, msg in seed_msgs.items():
        assert name in new_msgs, f"message {name} is missing"
        new_fields = {f.number: f for f in new_msgs[name].field}
        for f in msg.field:
            assert f.number in new_fields, f"{name}.{f.name} (#{f.number}) is missing"
            assert _field_key(new_fields[f.number]) == _field_key(f), f"{name}.{f.name} changed"
        assert [o.name for o in msg.oneof_decl] == [o.name for o in new_msgs[name].oneof_decl][:len(msg.oneof_decl)]
    new_enums = _enums(new)
    for name, values in _enums(seed).items():
        assert name in new_enums, f"enum {name} is missing"
        for v, n in values.items():
            assert new_enums[name].get(v) == n, f"enum value {name}.{v} changed"
    new_services = {s.name: {m.name: m for m in s.method} for s in new.service}
    for s in seed.service:
        for m in s.method:
            got = new_services[s.name][m.name]
            assert (got.input_type, got.output_type, got.server_streaming) == \
                   (m.input_type, m.output_type, m.server_streaming), f"{s.name}.{m.name} changed"
