"""The controller protocol (``rlctl.controller.v1``): the .proto and its committed Python stubs.

The .proto lives at ``rlctl/online/proto/rlctl/controller/v1/controller.proto`` (its folders follow
its package, with ``rlctl/online/proto`` as the include root); ``rlctl.online.proto.generate`` rewrites the
stubs. Import them from here.
"""
from rlctl.online.proto.rlctl.controller.v1 import controller_pb2, controller_pb2_grpc

SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name

__all__ = ["SERVICE_NAME", "controller_pb2", "controller_pb2_grpc"]
