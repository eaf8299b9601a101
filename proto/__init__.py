"""splitserve's gRPC API: splitserve.proto and its generated stubs (see splitserve.proto.build).

Use `from splitserve.proto import load_stubs; pb2, pb2_grpc = load_stubs()` rather than importing the
generated modules directly: it builds them when they are missing or stale.
"""

from .stubs import load_stubs

__all__ = ["load_stubs"]
