"""build_engine: the engine an EngineConfig asks for (EngineConfig.engine), as EngineProtocol.

Each engine is imported only when asked for, so a simulated replica never imports torch
(tests/test_layout.py checks that in a fresh interpreter). The replicas (runtime/engine_worker.py)
build their engines here, so tensor parallelism is refused here until the workers shard KV.
"""

from __future__ import annotations

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.engine_protocol import EngineProtocol


def build_engine(config: EngineConfig) -> EngineProtocol:
    if config.tensor_parallel_size > 1:  # the workers' KV transfer would move rank 0's KV heads only
        raise ConfigError(
            f"tensor_parallel_size {config.tensor_parallel_size} runs only in the colocated engine "
            "(splitserve generate) yet, not in a prefill or decode replica or the simulated engine"
        )
    if config.engine == "simulated":
        from splitserve.engine.simulated.simulated_engine import SimulatedEngine

        return SimulatedEngine(config)
    from splitserve.engine.llm_engine import LLMEngine  # torch

    return LLMEngine(config)
