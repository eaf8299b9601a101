"""build_engine: the engine an EngineConfig asks for (EngineConfig.engine), as EngineProtocol.

Each engine is imported only when asked for, so a simulated replica never imports torch
(tests/test_layout.py checks that in a fresh interpreter). The replicas (runtime/engine_worker.py)
build their engines here; a tensor-parallel replica hands in how its gang's follower ranks
start (launch_followers, engine/parallel/tp_ranks.py's FollowerLauncher) and what each runs
beside its forward (follower_extension, engine/parallel/follower_extension.py).
"""

from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_protocol import EngineProtocol


def build_engine(config: EngineConfig, launch_followers=None, follower_extension=None) -> EngineProtocol:
    if config.engine == "simulated":
        # A simulated TP replica steps by its profile's figures for that size; its follower ranks
        # (a served gang's actors) are never started: their share of the work is in the step time.
        from splitserve.engine.simulated.simulated_engine import SimulatedEngine

        return SimulatedEngine(config)
    from splitserve.engine.host_heap import retain_freed_heap
    from splitserve.engine.llm_engine import LLMEngine  # torch

    retain_freed_heap()  # the replica process's forwards (a library user's LLMEngine keeps its own heap)
    return LLMEngine(config, launch_followers, follower_extension)
