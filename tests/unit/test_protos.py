"""The committed stubs in csi_plugin/gen match protos/*.proto."""
import ast
import importlib
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]


def _serialized(stub_source: str) -> bytes:
    # protoc embeds the FileDescriptorProto as one bytes literal
    start = stub_source.index("AddSerializedFile(") + len("AddSerializedFile(")
    end = stub_source.index(")\n", start)
    return ast.literal_eval(stub_source[start:end])


@pytest.mark.parametrize("name", ["csi", "identity", "volumegroup", "replication", "admin"])
def test_generated_stubs_are_fresh(tmp_path, name):
    sys.path.insert(0, str(ROOT / "protos"))
    try:
        importlib.import_module("compile").compile_all(tmp_path)
    finally:
        sys.path.remove(str(ROOT / "protos"))
    # compare descriptors, not text: the text embeds the protoc version
    fresh = descriptor_pb2.FileDescriptorProto.FromString(_serialized((tmp_path / f"{name}_pb2.py").read_text()))
    committed = descriptor_pb2.FileDescriptorProto.FromString(
        _serialized((ROOT / "csi_plugin" / "gen" / f"{name}_pb2.py").read_text()))
    assert fresh == committed, f"csi_plugin/gen/{name}_pb2.py is stale: run python protos/compile.py"
