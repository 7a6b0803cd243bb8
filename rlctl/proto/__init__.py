"""The controller protocol (``rlctl.controller.v1``): the .proto and its committed Python stubs.

The .proto lives at ``rlctl/proto/rlctl/controller/v1/controller.proto`` (its folders follow
its package, with ``rlctl/proto`` as the include root); ``rlctl.proto.generate`` rewrites the
stubs. Import them from here.
"""
from rlctl.proto.rlctl.controller.v1 import controller_pb2, controller_pb2_grpc

SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name

__all__ = ["SERVICE_NAME", "controller_pb2", "controller_pb2_grpc"]
