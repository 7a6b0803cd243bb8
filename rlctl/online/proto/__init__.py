"""The controller protocol (``rlctl.controller.v1``): the .proto and its committed Python stubs.

The .proto lives at ``rlctl/online/proto/rlctl/controller/v1/controller.proto`` (its folders follow
its package, with ``rlctl/online/proto`` as the include root); ``rlctl.online.proto.generate`` rewrites the
stubs. Import them from here.

The stubs load on first use, not with this package: each checks the installed grpcio and protobuf
against the versions that generated it and refuses to load otherwise, and regenerating them with
another grpcio-tools (``python -m rlctl.online.proto.generate``) must not need the old ones to load.
"""
from __future__ import annotations

import importlib

__all__ = ["SERVICE_NAME", "controller_pb2", "controller_pb2_grpc"]


def __getattr__(name: str):
    if name in ("controller_pb2", "controller_pb2_grpc"):
        return importlib.import_module(f"{__name__}.rlctl.controller.v1.{name}")
    if name == "SERVICE_NAME":
        return __getattr__("controller_pb2").DESCRIPTOR.services_by_name["Controller"].full_name
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
