"""Import the generated splitserve stubs, building them first when missing or stale.

`make install` runs `python -m splitserve.proto.build`; this makes tests and `splitserve serve` work
without it (a fresh checkout, an edited .proto).
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """(splitserve_pb2, splitserve_pb2_grpc), regenerated from the .proto if needed."""
    # Imported here so `python -m splitserve.proto.build` does not find it already imported.
    from . import build as _build

    with _lock:
        if not _build.is_up_to_date():
            try:
                _build.build()
            except _build.ProtoBuildError:
                # A read-only install with an older build still serves; no build at all cannot.
                if not all((_build.PROTO_DIR / name).is_file() for name in _build.GENERATED_FILES):
                    raise
                logger.warning(
                    "the gRPC stubs are older than %s and cannot be rebuilt; using them",
                    _build.PROTO_FILE.name,
                    exc_info=True,
                )
        pb2 = importlib.import_module(f"{__package__}.{_build.STEM}_pb2")
        pb2_grpc = importlib.import_module(f"{__package__}.{_build.STEM}_pb2_grpc")
    return pb2, pb2_grpc
