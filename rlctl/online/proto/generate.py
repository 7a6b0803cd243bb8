"""Regenerate the controller protocol's Python stubs from its .proto (a developer's command).

    .venv/bin/python -m rlctl.online.proto.generate          # rewrites rlctl/online/proto/rlctl/controller/v1/*_pb2*.py[i]

The stubs are committed so that rlctl runs without grpcio-tools; tests/test_proto_stubs.py
regenerates them with the pinned grpcio-tools (pyproject.toml, the ``dev`` extra) and fails
when the committed ones differ. protoc writes absolute imports of the proto package
(``from rlctl.controller.v1 import controller_pb2``), which would resolve against this
repository's own ``rlctl`` package; the one fix made here turns them into relative imports, so
that the stubs import as ``rlctl.online.proto.rlctl.controller.v1``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent          # the proto root (-I): package paths start here
PROTO = Path("rlctl/controller/v1/controller.proto")
STUBS = ("controller_pb2.py", "controller_pb2.pyi", "controller_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Write the stubs for ``PROTO`` under ``out`` (in its package folders); the files written."""
    from grpc_tools import protoc  # dev dependency: only regeneration needs it

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"  # the well-known types
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {ROOT / PROTO}")
    folder = out / PROTO.parent
    package = ".".join(PROTO.parent.parts)
    for name in STUBS:
        path = folder / name
        text = re.sub(rf"^from {re.escape(package)} import ", "from . import ", path.read_text(), flags=re.M)
        path.write_text(text)
    return [folder / name for name in STUBS]


if __name__ == "__main__":
    for p in generate(ROOT):
        print(f"wrote {p}")
    sys.exit(0)
