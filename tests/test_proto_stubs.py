"""The committed protocol stubs are exactly what the pinned grpcio-tools generates from the .proto
(the CI check): an edited .proto without regenerated stubs, or a hand-edited stub, fails here.
Regenerate with ``.venv/bin/python -m rlctl.online.proto.generate``."""
from __future__ import annotations

import re
from importlib import metadata

import pytest

from rlctl.online.proto import generate


def pinned_grpcio_tools() -> str:
    text = (generate.ROOT.parents[2] / "pyproject.toml").read_text()
    match = re.search(r'"grpcio-tools==([^"]+)"', text)
    assert match, "pyproject.toml must pin grpcio-tools (the dev extra)"
    return match.group(1)


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the stubs")
    installed = metadata.version("grpcio-tools")
    assert installed == pinned_grpcio_tools(), (f"grpcio-tools {installed} is installed, pyproject.toml pins "
                                                f"{pinned_grpcio_tools()}: install the pin to check the stubs")
    fresh = generate.generate(tmp_path)
    committed = generate.ROOT / generate.PROTO.parent
    for path in fresh:
        ours = committed / path.name
        assert ours.exists(), f"{ours} is missing: run python -m rlctl.online.proto.generate"
        assert ours.read_text() == path.read_text(), f"{ours} differs from a fresh generation: run python -m rlctl.online.proto.generate"


def test_the_stubs_import_as_a_package_and_name_the_versioned_service():
    from rlctl.online.proto import SERVICE_NAME, controller_pb2, controller_pb2_grpc

    assert SERVICE_NAME == "rlctl.controller.v1.Controller"
    assert controller_pb2.DESCRIPTOR.name == "rlctl/controller/v1/controller.proto"
    assert {m.name for m in controller_pb2.DESCRIPTOR.services_by_name["Controller"].methods} == {
        "Decide", "Live", "DecideNode", "GetPolicy", "ReloadPolicy"}
    assert hasattr(controller_pb2_grpc, "ControllerStub")
