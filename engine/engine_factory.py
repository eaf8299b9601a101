"""build_engine: the engine an EngineConfig asks for (EngineConfig.engine), as EngineProtocol.

Each engine is imported only when asked for, so a simulated replica never imports torch
(tests/test_layout.py checks that in a fresh interpreter).
"""

from __future__ import annotations

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.engine_protocol import EngineProtocol


def build_engine(config: EngineConfig) -> EngineProtocol:
    if config.engine == "simulated":
        if config.tensor_parallel_size > 1:
            raise ConfigError(
                f"tensor_parallel_size {config.tensor_parallel_size} does not support the simulated engine yet"
            )
        from splitserve.engine.simulated.simulated_engine import SimulatedEngine

        return SimulatedEngine(config)
    from splitserve.engine.llm_engine import LLMEngine  # torch

    return LLMEngine(config)
