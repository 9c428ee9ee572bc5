"""Regenerate the Python stubs in csi_plugin/gen from protos/*.proto.

Run ``python protos/compile.py`` after editing a .proto file. protoc emits
absolute imports between generated modules; they are rewritten to relative
imports so the stubs live inside the ``csi_plugin.gen`` package.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "csi_plugin" / "gen"
_IMPORT = re.compile(r"^import (\w+_pb2)( as \w+)?$", re.M)


def compile_all(out_dir: Path = OUT_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(p) for p in protos]) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py")):
        text = path.read_text()
        path.write_text(_IMPORT.sub(lambda m: f"from . import {m.group(1)}{m.group(2) or ''}", text))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in compile_all(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
