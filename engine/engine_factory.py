"""build_engine: the engine an EngineConfig asks for, as EngineProtocol.

Each engine is imported only when asked for, so a simulated replica never imports torch
(tests/test_layout.py checks that in a fresh interpreter).
"""

from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_protocol import EngineProtocol


def build_engine(config: EngineConfig) -> EngineProtocol:
    from splitserve.engine.llm_engine import LLMEngine  # torch

    return LLMEngine(config)
